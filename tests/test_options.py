"""The loss options: each vocabulary defined once, checked once per entry point, with one message
that names the option as the user typed it there (docs/contract.md, "Options at each entry point")."""

from __future__ import annotations

import dataclasses
import types
import typing

import pytest
import torch

import hf_infcl
from hf_infcl.ops import options, ring


def test_vocabularies_and_the_ring_codes_are_unchanged():
    assert options.LOSSES == ("softmax", "sigmoid")
    assert options.REDUCTIONS == ("mean", "sum", "none")
    assert options.BACKENDS == ("auto", "torch", "triton", "reference")
    assert options.PRECISIONS == ("auto", "tf32", "ieee")
    # the ring's wire protocol: ranks of different versions must keep agreeing
    assert ring._LOSS_CODES == {"softmax": 1, "sigmoid": 2}
    assert ring._PRECISION_CODES == {"auto": 1, "tf32": 2, "ieee": 3}
    assert ring._REDUCTION_CODES == {"mean": 1, "sum": 2, "none": 3}
    from hf_infcl import loss

    # one import path: the vocabularies are options', not re-exported by the loss
    assert not any(hasattr(loss, name) for name in ("LOSSES", "REDUCTIONS", "BACKENDS", "PRECISIONS"))


def test_one_message_naming_the_option_as_typed_at_each_entry_point(tmp_path):
    q = torch.randn(4, 3)
    expected = "precision must be one of 'auto', 'tf32', 'ieee'; got 'fp8'"
    with pytest.raises(ValueError) as raised:
        hf_infcl.contrastive_loss(q, q, precision="fp8")
    assert str(raised.value) == expected
    with pytest.raises(ValueError) as raised:
        hf_infcl.InfCLLoss(precision="fp8")
    assert str(raised.value) == expected
    with pytest.raises(ValueError) as raised:
        options.LossOptions(precision="fp8")
    assert str(raised.value) == expected

    from hf_infcl import InfCLTrainingArguments

    with pytest.raises(ValueError) as raised:
        InfCLTrainingArguments(output_dir=str(tmp_path), use_cpu=True, loss_backend="cuda")
    assert str(raised.value) == ("loss_backend must be one of 'auto', 'torch', 'triton', 'reference'; "
                                 "got 'cuda'")
    with pytest.raises(ValueError) as raised:
        InfCLTrainingArguments(output_dir=str(tmp_path), use_cpu=True, contrastive_loss="hinge")
    assert str(raised.value) == "contrastive_loss must be one of 'softmax', 'sigmoid' or None; got 'hinge'"


def test_sentence_transformers_loss_takes_backend_names_only():
    pytest.importorskip("sentence_transformers")
    from hf_infcl import losses

    model = torch.nn.Linear(2, 2)  # never called: the options fail first
    with pytest.raises(ValueError, match="^backend must be one of 'auto', 'torch', 'triton', 'reference'; "):
        losses.InfCLLoss(model, backend=hf_infcl.TorchTiles())


def test_module_holds_frozen_checked_options():
    module = hf_infcl.InfCLLoss(logit_scale=5.0, loss="sigmoid", symmetric=False, backend="torch")
    assert module.options == options.LossOptions(loss="sigmoid", symmetric=False, backend="torch")
    with pytest.raises(dataclasses.FrozenInstanceError):
        module.options.loss = "softmax"
    module.reduction = "sum"  # assigning an option replaces the options with a checked copy
    assert module.options.reduction == "sum" and module.reduction == "sum"
    with pytest.raises(ValueError, match="^reduction must be one of 'mean', 'sum', 'none'; got 'max'$"):
        module.reduction = "max"
    with pytest.raises(TypeError, match="symmetric must be a bool"):
        hf_infcl.InfCLLoss(symmetric="yes")
    q, k = torch.randn(4, 3, dtype=torch.float64), torch.randn(4, 3, dtype=torch.float64)
    expected = hf_infcl.contrastive_loss(q, k, 5.0, loss="sigmoid", symmetric=False, reduction="sum",
                                         backend="torch")
    torch.testing.assert_close(module(q, k), expected, rtol=0, atol=0)


def test_parser_lists_the_choices_of_the_trainer_options():
    from transformers import HfArgumentParser

    from hf_infcl import InfCLTrainingArguments

    choices = {action.dest: action.choices for action in HfArgumentParser(InfCLTrainingArguments)._actions}
    assert tuple(choices["loss_backend"]) == options.BACKENDS
    assert tuple(choices["precision"]) == options.PRECISIONS
    assert tuple(choices["contrastive_loss"]) == options.LOSSES
    assert tuple(choices["chunk_gradient_sync"]) == ("step", "chunk")


@pytest.mark.parametrize("name", ["chunk_size", "logit_scale_max", "eval_block_rows", "label_smoothing"])
def test_the_numeric_fields_the_trainer_arguments_check_themselves(tmp_path, name):
    """The examples leave these to InfCLTrainingArguments (its checked_numeric_fields)."""
    from hf_infcl import InfCLTrainingArguments

    assert name in InfCLTrainingArguments.checked_numeric_fields
    value = {"logit_scale_max": 0.0, "label_smoothing": 1.5}.get(name, 0)
    with pytest.raises(ValueError, match=name):
        InfCLTrainingArguments(output_dir=str(tmp_path), use_cpu=True, **{name: value})


def added_trainer_fields() -> list[str]:
    """The fields InfCLTrainingArguments adds to TrainingArguments, read from the dataclasses."""
    from transformers import TrainingArguments

    from hf_infcl import InfCLTrainingArguments

    inherited = {f.name for f in dataclasses.fields(TrainingArguments)}
    return [f.name for f in dataclasses.fields(InfCLTrainingArguments) if f.init and f.name not in inherited]


def accepted_types(hint) -> tuple[type, ...]:
    """The Python types a field annotation admits (a Literal admits its values' types)."""
    if typing.get_origin(hint) is typing.Literal:
        return tuple({type(value) for value in typing.get_args(hint)})
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return tuple(t for arg in typing.get_args(hint) for t in accepted_types(arg))
    if typing.get_origin(hint) is list:  # a list of its items' type: the list is what is typed
        return (list,)
    return (float, int) if hint is float else (hint,)


def wrong_typed_values(hint) -> list:
    """Values of every common type the annotation does not admit (a bool is no int here)."""
    accepted = accepted_types(hint)
    candidates = ["yes", 3, 2.5, True, None, [1], b"x"]
    return [value for value in candidates
            if (bool not in accepted if isinstance(value, bool) else not isinstance(value, accepted))]


def test_every_added_trainer_field_has_one_check():
    from hf_infcl.training_args import FIELD_CHECKS

    assert list(FIELD_CHECKS) == added_trainer_fields()


@pytest.mark.parametrize("name", added_trainer_fields())
def test_every_added_trainer_field_refuses_a_wrong_type_at_construction(tmp_path, name):
    """A wrong type fails when the arguments are built, naming the field: not later in train()."""
    from hf_infcl import InfCLTrainingArguments

    wrong = wrong_typed_values(typing.get_type_hints(InfCLTrainingArguments)[name])
    assert wrong, f"no wrong-typed value found for {name}"
    for value in wrong:
        with pytest.raises((TypeError, ValueError)) as raised:
            InfCLTrainingArguments(output_dir=str(tmp_path), use_cpu=True, **{name: value})
        assert str(raised.value).startswith(f"{name} must be "), (name, value, str(raised.value))


# A value of the right type outside what the field allows, per field that has a range or choices.
OUT_OF_RANGE = {
    "chunk_size": [0, -4], "loss_backend": ["cuda"], "precision": ["fp8"], "contrastive_loss": ["hinge"],
    "logit_scale_max": [0.0, -1.0, float("nan")], "chunk_gradient_sync": ["never"],
    "chunk_parameter_gather": ["never"], "eval_block_rows": [0, -1],
}


@pytest.mark.parametrize("name", sorted(OUT_OF_RANGE))
def test_trainer_fields_out_of_range_are_named(tmp_path, name):
    from hf_infcl import InfCLTrainingArguments

    for value in OUT_OF_RANGE[name]:
        with pytest.raises(ValueError, match=f"^{name} must be "):
            InfCLTrainingArguments(output_dir=str(tmp_path), use_cpu=True, **{name: value})


def test_compiled_module_reads_its_options_without_a_graph_break():
    torch._dynamo.reset()
    module = hf_infcl.InfCLLoss(logit_scale=5.0, symmetric=False, backend="torch")
    q, k = torch.randn(6, 4, dtype=torch.float64), torch.randn(6, 4, dtype=torch.float64)
    compiled = torch.compile(module, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(q, k), module(q, k), rtol=1e-12, atol=0)


def test_one_chunk_size_rule_with_one_message_at_every_entry_point(tmp_path):
    """The Trainer's arguments, cached_step and a script's flags check the chunk size with the one
    rule of hf_infcl.ops.options, each naming the options as its user spells them."""
    from hf_infcl import InfCLTrainingArguments
    from hf_infcl.grad_cache import cached_step

    for option in ("offload", "chunk_cuda_graphs"):
        with pytest.raises(ValueError) as raised:
            InfCLTrainingArguments(output_dir=str(tmp_path), use_cpu=True, **{option: True})
        with pytest.raises(ValueError) as direct:
            options.check_chunking(None, {f"{option}=True": True})
        assert str(raised.value) == str(direct.value)
        assert str(raised.value).startswith(f"{option}=True needs chunk_size: ")
    with pytest.raises(ValueError, match="^--reduce_every_chunk needs --chunk_size: .*without --chunk_size"):
        options.check_chunking(None, {"--offload": False, "--reduce_every_chunk": True}, name="--chunk_size")
    with pytest.raises(ValueError, match="^--chunk_size must be a positive int or None, got 0$"):
        options.check_chunking(0, {"--offload": True}, name="--chunk_size")
    options.check_chunking(4, {"--offload": True}, name="--chunk_size")  # with chunks, the options apply
    options.check_chunking(None, {"--offload": False}, name="--chunk_size")
    with pytest.raises(ValueError, match="^chunk_size must be a positive int or None, got True$"):
        cached_step(lambda chunk: chunk["x"], {"x": torch.randn(4, 2)}, lambda x: x.sum(), True)


@pytest.mark.parametrize("value", [0, -3, True, 2.0, "4"], ids=repr)
def test_every_positive_int_option_is_checked_by_one_rule(value):
    """Block sizes, graph counts, lengths: one rule and one message, bools refused (True is an int)."""
    from hf_infcl import TorchTiles
    from hf_infcl.metrics import relevant_ranks

    message = f"must be a positive int, got {value!r}$"
    with pytest.raises(ValueError, match="^tile_rows " + message):
        TorchTiles(tile_rows=value)
    with pytest.raises(ValueError, match="^block_rows " + message):
        relevant_ranks(torch.randn(2, 3), torch.randn(2, 3), block_rows=value)
    with pytest.raises(ValueError, match="^max_graphs must be a positive int or None, got "):
        options.check_positive_int("max_graphs", value, optional=True)
    options.check_positive_int("max_graphs", None, optional=True)
    options.check_positive_int("warmup", 1)


@pytest.mark.parametrize("strength", [-1.0, float("nan"), "2", True],
                         ids=["negative", "nan", "string", "bool"])
def test_one_hardness_check_for_the_loss_and_the_sentence_transformers_loss(strength):
    """contrastive_loss and the sentence-transformers loss refuse the same hardness strengths, with
    the same error type (the latter in MNRL's words first)."""
    pytest.importorskip("sentence_transformers")
    from hf_infcl import losses

    q = torch.randn(4, 3)
    ids = torch.arange(4)
    with pytest.raises((TypeError, ValueError)) as functional:
        hf_infcl.contrastive_loss(q, q, hardness_mode="hard_negatives", hardness_strength=strength,
                                  query_ids=ids, key_owners=ids)
    with pytest.raises((TypeError, ValueError)) as sentence_transformers:
        losses.InfCLLoss(torch.nn.Linear(2, 2), hardness_mode="hard_negatives", hardness_strength=strength)
    assert type(functional.value) is type(sentence_transformers.value)
    assert "hardness_strength" in str(sentence_transformers.value)
