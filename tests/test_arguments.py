"""Bad input fails before any computation, with the right error type naming the argument."""

from __future__ import annotations

import pytest
import torch

from hf_infcl import InfCLLoss, contrastive_loss


def good_arguments():
    gen = torch.Generator().manual_seed(0)
    return {
        "queries": torch.randn(4, 8, generator=gen),
        "keys": torch.randn(6, 8, generator=gen),
        "logit_scale": 10.0,
    }


def _with(**changes):
    def build():
        arguments = good_arguments()
        for name, value in changes.items():
            arguments[name] = value(arguments) if callable(value) else value
        return arguments

    return build


# A valid hardness setting, which the cases below break one argument at a time.
HARDNESS = dict(hardness_mode="in_batch_negatives", hardness_strength=2.0, query_ids=torch.arange(4),
                key_owners=torch.arange(6) - 1)


def _hardness_with(**changes):
    return _with(**{**HARDNESS, **changes})

BAD_INPUTS = {
    "queries-not-tensor": (_with(queries=[[1.0, 2.0]]), TypeError, "queries"),
    "queries-1d": (_with(queries=torch.randn(8)), ValueError, "queries"),
    "keys-3d": (_with(keys=torch.randn(2, 6, 8)), ValueError, "keys"),
    "queries-integer": (_with(queries=torch.ones(4, 8, dtype=torch.long)), TypeError, "queries"),
    "width-mismatch": (_with(keys=torch.randn(6, 7)), ValueError, "width"),
    "dtype-mismatch": (_with(keys=lambda a: a["keys"].double()), TypeError, "keys"),
    "zero-rows": (_with(queries=torch.randn(0, 8)), ValueError, "queries"),
    "zero-width": (_with(queries=torch.randn(4, 0), keys=torch.randn(6, 0)), ValueError, "width"),
    "fewer-keys-than-rows": (_with(keys=torch.randn(3, 8)), ValueError, "keys"),
    "positives-out-of-range": (_with(positives=torch.tensor([0, 1, 2, 6])), ValueError, "positives"),
    "positives-negative": (_with(positives=torch.tensor([0, -1, 2, 3])), ValueError, "positives"),
    "positives-wrong-length": (_with(positives=torch.tensor([0, 1, 2])), ValueError, "positives"),
    "positives-float": (_with(positives=torch.tensor([0.0, 1.0, 2.0, 3.0])), TypeError, "positives"),
    "query-groups-wrong-length": (
        _with(query_groups=torch.zeros(3, dtype=torch.long), key_groups=torch.zeros(6, dtype=torch.long)),
        ValueError, "query_groups"),
    "key-groups-wrong-length": (
        _with(query_groups=torch.zeros(4, dtype=torch.long), key_groups=torch.zeros(4, dtype=torch.long)),
        ValueError, "key_groups"),
    "query-groups-alone": (_with(query_groups=torch.zeros(4, dtype=torch.long)), ValueError, "key_groups"),
    "groups-float": (
        _with(query_groups=torch.zeros(4), key_groups=torch.zeros(6)), TypeError, "query_groups"),
    "scale-zero": (_with(logit_scale=0.0), ValueError, "logit_scale"),
    "scale-negative-tensor": (_with(logit_scale=torch.tensor(-2.0)), ValueError, "logit_scale"),
    "scale-vector": (_with(logit_scale=torch.ones(3)), ValueError, "logit_scale"),
    "scale-string": (_with(logit_scale="10"), TypeError, "logit_scale"),
    "bias-vector": (_with(logit_bias=torch.ones(2)), ValueError, "logit_bias"),
    "loss-unknown": (_with(loss="hinge"), ValueError, "loss"),
    "reduction-unknown": (_with(reduction="avg"), ValueError, "reduction"),
    "backend-unknown": (_with(backend="cuda"), ValueError, "backend"),
    "precision-unknown": (_with(precision="fp8"), ValueError, "precision"),
    "triton-on-cpu": (_with(backend="triton"), ValueError, "triton"),
    "symmetric-not-bool": (_with(symmetric="yes"), TypeError, "symmetric"),
    "process-group-unknown-string": (_with(process_group="world"), ValueError, "process_group"),
    "hardness-mode-unknown": (_hardness_with(hardness_mode="hardest"), ValueError, "hardness_mode"),
    "hardness-strength-negative": (_hardness_with(hardness_strength=-1.0), ValueError,
                                   "hardness_strength"),
    "hardness-strength-nan": (_hardness_with(hardness_strength=float("nan")), ValueError,
                              "hardness_strength"),
    "hardness-strength-string": (_hardness_with(hardness_strength="2"), TypeError, "hardness_strength"),
    "hardness-strength-without-mode": (_with(hardness_strength=2.0), ValueError, "hardness_mode"),
    "hardness-without-ids": (_with(hardness_mode="hard_negatives", hardness_strength=2.0), ValueError,
                             "query_ids and key_owners"),
    "hardness-ids-without-mode": (_with(query_ids=torch.arange(4), key_owners=torch.arange(6)), ValueError,
                                  "query_ids/key_owners"),
    "query-ids-wrong-length": (_hardness_with(query_ids=torch.arange(3)), ValueError, "query_ids"),
    "key-owners-float": (_hardness_with(key_owners=torch.zeros(6)), TypeError, "key_owners"),
    "hardness-with-sigmoid": (_hardness_with(loss="sigmoid"), ValueError, "hardness_mode"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_names_the_argument(case, monkeypatch):
    build, error_type, named = BAD_INPUTS[case]
    arguments = build()
    # Fail loudly if any computation started: the checks must come first.
    from hf_infcl.ops import reference
    from hf_infcl.ops.tiled import TorchTiles

    def no_compute(*args, **kwargs):
        raise AssertionError("computation started before the arguments were checked")

    monkeypatch.setattr(TorchTiles, "forward_block", no_compute)
    monkeypatch.setattr(reference, "per_row_loss", no_compute)
    with pytest.raises(error_type, match=named):
        contrastive_loss(**arguments)


def test_device_mismatch_is_named():
    if not torch.cuda.is_available():
        # Use the meta device as the "other" device so the check runs everywhere.
        keys = torch.randn(6, 8, device="meta")
    else:
        keys = torch.randn(6, 8, device="cuda")
    with pytest.raises(ValueError, match="keys"):
        contrastive_loss(torch.randn(4, 8), keys)


def test_module_checks_options_at_construction():
    with pytest.raises(ValueError, match="loss"):
        InfCLLoss(loss="triplet")
    with pytest.raises(ValueError, match="reduction"):
        InfCLLoss(reduction="max")


def test_good_arguments_run():
    assert torch.isfinite(contrastive_loss(**good_arguments()))
    assert torch.isfinite(contrastive_loss(**good_arguments(), **HARDNESS))
