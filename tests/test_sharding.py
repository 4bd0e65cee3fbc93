"""hf_infcl.sharding on plain tensors (the FSDP2 and DeepSpeed paths run in test_trainer_fsdp,
test_fsdp and test_examples_fsdp)."""

from __future__ import annotations

import torch

from hf_infcl.sharding import full_value, is_dtensor, scalar_state_dict, vectorise_scalar_parameters
from tests.helpers.trainer_fixtures import tiny_clip


def test_scalar_parameters_become_vectors_in_the_model_and_the_optimizer_and_save_back_0d():
    model = tiny_clip()
    before = model.logit_scale
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    names = vectorise_scalar_parameters(model, optimizer)
    assert names == ["logit_scale"]
    assert model.logit_scale.shape == (1,) and float(model.logit_scale) == float(before)
    held = [p for group in optimizer.param_groups for p in group["params"]]
    assert any(p is model.logit_scale for p in held) and not any(p is before for p in held)
    restored = scalar_state_dict(model.state_dict(), names)
    assert restored["logit_scale"].shape == () and float(restored["logit_scale"]) == float(before)
    assert model.state_dict()["logit_scale"].shape == (1,)  # a copy: the model keeps its vector


def test_full_value_of_a_plain_tensor_is_the_tensor():
    tensor = torch.randn(3)
    assert full_value(tensor) is tensor and not is_dtensor(tensor)
