"""The options, each defined once: its vocabulary, its check, its one error message.

The one module every entry point (``contrastive_loss``, the Trainer's arguments, the
sentence-transformers loss, the examples) imports the options from. Every entry point takes them
under the name its ecosystem uses (``backend`` here, ``loss_backend`` in the Trainer's arguments,
``--precision`` on an example's command line; the table is in docs/contract.md, "Options") and
checks them once, with :func:`check_option` and the checks below, naming the option as the user
typed it:

    precision must be one of 'auto', 'tf32', 'ieee'; got 'fp8'

Beside the loss's options: the label smoothing (:func:`check_label_smoothing`), the hardness
offset (:func:`check_hardness`), several positives and the score filter
(:func:`check_objective_options`), the Matryoshka prefixes (:func:`check_matryoshka`) and gradient
caching's chunk size (:func:`check_chunking`).

The vocabularies are ``Literal`` types, so a dataclass field typed with one gets argparse choices
from ``HfArgumentParser``, and the tuples below are derived from them (never written twice). The
ring's wire codes (:func:`wire_codes`) come from the same tuples.

The bottom of the layering: this module imports nothing from hf_infcl, so ``hf_infcl.ops`` and
everything above it can use it.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, get_args

LossKind = Literal["softmax", "sigmoid"]
Reduction = Literal["mean", "sum", "none"]
BlockBackend = Literal["torch", "triton"]  # the backends that compute (what "auto" resolves to)
BackendName = Literal["auto", BlockBackend, "reference"]
Precision = Literal["auto", "tf32", "ieee"]
HardnessMode = Literal["in_batch_negatives", "hard_negatives", "all_negatives"]  # docs/contract.md
# docs/contract.md, "Several positives per row" and "False negatives by score"
GroupPositives = Literal["any", "each"]
FalseNegativeStrategy = Literal["absolute", "relative"]

LOSSES: tuple[str, ...] = get_args(LossKind)
REDUCTIONS: tuple[str, ...] = get_args(Reduction)
BLOCK_BACKENDS: tuple[str, ...] = get_args(BlockBackend)
BACKENDS: tuple[str, ...] = get_args(BackendName)  # ("auto", "torch", "triton", "reference")
PRECISIONS: tuple[str, ...] = get_args(Precision)
HARDNESS_MODES: tuple[str, ...] = get_args(HardnessMode)
GROUP_POSITIVES: tuple[str, ...] = get_args(GroupPositives)
FALSE_NEGATIVE_STRATEGIES: tuple[str, ...] = get_args(FalseNegativeStrategy)

_VOCABULARIES = {"loss": LOSSES, "reduction": REDUCTIONS, "backend": BACKENDS, "precision": PRECISIONS}


def choice_error(name: str, value, allowed, *, optional: bool = False) -> ValueError:
    """The one message for a value outside its vocabulary, naming the option ``name``."""
    choices = ", ".join(map(repr, allowed)) + (" or None" if optional else "")
    return ValueError(f"{name} must be one of {choices}; got {value!r}")


def check_choice(name: str, value, allowed, *, optional: bool = False) -> None:
    """Raise :func:`choice_error` unless ``value`` is one of the strings ``allowed`` (or None,
    when ``optional``)."""
    if optional and value is None:
        return
    if not isinstance(value, str) or value not in allowed:
        raise choice_error(name, value, allowed, optional=optional)


def check_bool(name: str, value, *, optional: bool = False) -> None:
    """Raise a TypeError naming ``name`` unless ``value`` is a bool (not merely truthy), or None
    when ``optional``."""
    if optional and value is None:
        return
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool{' or None' if optional else ''}, got {type(value).__name__}")


def check_option(field: str, value, name: str | None = None, *, optional: bool = False,
                 block_ops: bool = True) -> None:
    """The one check of one loss option.

    Args:
        field: the option, a :class:`LossOptions` field (``"loss"``, ``"symmetric"``,
            ``"reduction"``, ``"backend"``, ``"precision"``).
        value: what the user gave.
        name: how the user spelled the option at this entry point (``"loss_backend"``,
            ``"--precision"``); the error names it. Default: ``field``.
        optional: None is allowed too (the Trainer's ``contrastive_loss``).
        block_ops: ``backend`` may be a block-ops object (an object with ``forward_block`` and
            ``backward_block``), not only a name.
    """
    name = field if name is None else name
    if field == "symmetric":
        check_bool(name, value)
        return
    if field == "backend" and block_ops and not isinstance(value, str):
        if not (hasattr(value, "forward_block") and hasattr(value, "backward_block")):
            raise TypeError(f"{name} must be a name or a block-ops object, got {type(value).__name__}")
        return
    check_choice(name, value, _VOCABULARIES[field], optional=optional)


def check_label_smoothing(label_smoothing, loss: str, *, grouped: bool = False, hardness: bool = False,
                          name: str = "label_smoothing", groups: str = "query_groups/key_groups",
                          filtered: bool = False, margin: str = "false_negative_margin") -> None:
    """The one check of ``label_smoothing`` (docs/contract.md, "Label smoothing"): a number in
    [0, 1], and positive only with the softmax loss, without groups, without a hardness offset and
    without the score filter. ``name``, ``groups``, ``margin``: how the caller's user spells the
    option, the group ids and the margin."""
    if isinstance(label_smoothing, bool) or not isinstance(label_smoothing, (int, float)):
        raise TypeError(f"{name} must be a float in [0, 1], got {type(label_smoothing).__name__}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"{name} must be in [0, 1], got {label_smoothing!r}")
    if not label_smoothing:
        return
    if loss != "softmax":
        raise ValueError(f"{name}={label_smoothing!r} needs loss='softmax' (it smooths cross-entropy "
                         f"targets), got loss={loss!r}")
    if grouped:
        raise ValueError(f"{name}={label_smoothing!r} is not defined with {groups} (a row's candidates would "
                         "be its allowed keys only); leave one of them out")
    if hardness:
        raise ValueError(f"{name}={label_smoothing!r} is not defined with a hardness offset (its uniform "
                         "target would include the offsets); leave one of them out")
    if filtered:
        raise ValueError(f"{name}={label_smoothing!r} is not defined with {margin} (a row's candidates would "
                         "be the keys the filter keeps); leave one of them out")


def check_distillation_weight(value, name: str = "distillation_weight") -> float:
    """The one check of distillation's mix (docs/contract.md, "Distillation over the batch"): a number
    in [0, 1], the weight of the KL term against the softmax loss's; returned as a float."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a float in [0, 1], got {type(value).__name__}")
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{name} must be in [0, 1], got {value!r}")
    return float(value)


def check_objective_options(group_positives, false_negative_margin, false_negative_strategy, *,
                            names=("group_positives", "false_negative_margin", "false_negative_strategy")
                            ) -> float | None:
    """The one check of the several-positives and score-filter options that are not tensors; returns
    the margin as a float (or None). ``names``: how the caller's user spells the three."""
    positives_name, margin_name, strategy_name = names
    check_choice(positives_name, group_positives, GROUP_POSITIVES, optional=True)
    check_choice(strategy_name, false_negative_strategy, FALSE_NEGATIVE_STRATEGIES)
    return check_false_negative_margin(false_negative_margin, margin_name)


def check_false_negative_margin(value, name: str = "false_negative_margin") -> float | None:
    """The one check of the score filter's margin: None (off) or a finite number, negative ones
    included (a threshold above the positive's score); returned as a float."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a finite float or None, got {type(value).__name__}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value!r}")
    return float(value)


def _sequence_of(values, kind: type, what: str, name: str) -> Sequence:
    """``values``, checked to be a sequence (not a string) of ``kind`` (bools refused), ``what``
    naming them in the TypeError."""
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise TypeError(f"{name} must be a sequence of {what}, got {type(values).__name__}")
    for value in values:
        if isinstance(value, bool) or not isinstance(value, kind):
            raise TypeError(f"{name} must hold {what}, got {value!r} ({type(value).__name__})")
    return values


def check_matryoshka_dims(dims, width: int | None = None, name: str = "matryoshka_dims") -> tuple[int, ...]:
    """Matryoshka widths alone: a non-empty sequence of ints, strictly descending, each in
    ``[1, width]`` (``width`` None: not known here, the upper bound unchecked); as a tuple."""
    dims = tuple(int(dim) for dim in _sequence_of(dims, numbers.Integral, "ints", name))
    if not dims:
        raise ValueError(f"{name} is empty; give at least one prefix width")
    if any(dim < 1 for dim in dims):
        raise ValueError(f"{name} must be widths >= 1, got {dims}")
    if width is not None and dims[0] > width:
        raise ValueError(f"{name} {dims} has a width above the features' width {width}")
    if any(wider <= narrower for wider, narrower in zip(dims, dims[1:])):
        raise ValueError(f"{name} must be strictly descending (widest first, no repeats), got {dims}")
    return dims


def check_matryoshka_weights(weights, name: str = "matryoshka_weights") -> tuple[float, ...]:
    """Matryoshka weights alone: a sequence of finite non-negative numbers; as a tuple of floats."""
    weights = tuple(float(weight) for weight in _sequence_of(weights, numbers.Real, "numbers", name))
    if not all(math.isfinite(weight) and weight >= 0.0 for weight in weights):
        raise ValueError(f"{name} must be finite and non-negative, got {weights}")
    return weights


def check_matryoshka(dims, weights, width: int | None = None, *,
                     names=("matryoshka_dims", "matryoshka_weights"),
                     ) -> tuple[tuple[int, ...], tuple[float, ...]] | None:
    """The one check of the Matryoshka prefixes (docs/contract.md, "Matryoshka in one call"): the
    widths (:func:`check_matryoshka_dims`), the weights (:func:`check_matryoshka_weights`; None: 1
    each) and their agreement, one weight per width. Returns (dims, weights) as tuples of int and
    float, or None when ``dims`` is None (no prefixes; then ``weights`` must be None too).
    ``names``: how the caller's user spells the two."""
    dims_name, weights_name = names
    if dims is None:
        if weights is not None:
            raise ValueError(f"{weights_name} was given without {dims_name}; the weights are those of the "
                             "prefix losses")
        return None
    dims = check_matryoshka_dims(dims, width, dims_name)
    if weights is None:
        return dims, (1.0,) * len(dims)
    weights = check_matryoshka_weights(weights, weights_name)
    if len(weights) != len(dims):
        raise ValueError(f"{weights_name} has {len(weights)} weights but {dims_name} has {len(dims)} dims; "
                         "give one weight per dim")
    return dims, weights


def check_hardness_strength(value, name: str = "hardness_strength") -> None:
    """A hardness strength is a non-negative float (an int too; a bool or NaN is refused)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a non-negative float, got {type(value).__name__}")
    if not value >= 0.0:
        raise ValueError(f"{name} must be non-negative, got {value!r}")


def check_hardness(hardness_mode, hardness_strength) -> None:
    """The one check of a hardness setting (docs/contract.md, "Hardness offset"): the mode one of
    :data:`HARDNESS_MODES` or None, the strength non-negative (:func:`check_hardness_strength`).
    Which settings apply the offset is each entry point's: ``contrastive_loss`` refuses a strength
    without a mode; the sentence-transformers loss, as MNRL, computes its plain loss then."""
    check_choice("hardness_mode", hardness_mode, HARDNESS_MODES, optional=True)
    check_hardness_strength(hardness_strength)


def check_positive_int(name: str, value, *, optional: bool = False) -> None:
    """A positive int (not a bool), or None where ``optional``; ValueError naming ``name`` otherwise."""
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int{' or None' if optional else ''}, got {value!r}")


def check_chunk_size(name: str, value) -> None:
    """A chunk size is a positive int, or None (one chunk); ValueError naming ``name`` otherwise."""
    check_positive_int(name, value, optional=True)


def check_chunking(chunk_size, chunked: Mapping[str, Any] | None = None, *, name: str = "chunk_size") -> None:
    """The one rule of gradient caching's chunk size, with its one message: ``chunk_size`` (spelled
    ``name`` at the entry point) is a positive int or None (:func:`check_chunk_size`), and the options
    that act on the chunks of a cached step are on only with one. ``chunked`` maps each such option,
    as the entry point's user spells it set, to its value.

    For a script's flags: ``check_chunking(args.chunk_size, {"--offload": args.offload,
    "--reduce_every_chunk": args.reduce_every_chunk}, name="--chunk_size")``.
    """
    check_chunk_size(name, chunk_size)
    if chunk_size is not None:
        return
    for option, value in (chunked or {}).items():
        if value:
            raise ValueError(f"{option} needs {name}: it acts on the chunks of a cached step, and without "
                             f"{name} the encoders see the whole batch at once")


def check_graphs_chunking(no_grad_chunk_size, chunk_size, graphs: bool, *, graphs_name: str = "chunk_graphs",
                          name: str = "no_grad_chunk_size") -> None:
    """CUDA-graphed chunks need the no-grad pass to chunk like the replays: one graph per chunk
    shape serves both passes. ``graphs``: whether the graphs are on (``graphs_name`` as the entry
    point spells them); ``name``: how it spells ``no_grad_chunk_size``."""
    if graphs and no_grad_chunk_size is not None and no_grad_chunk_size != chunk_size:
        raise ValueError(f"{graphs_name} needs the no-grad pass to chunk like the replays: leave {name} "
                         "unset (the graphs remove what larger no-grad chunks save)")


def wire_codes(vocabulary: tuple[str, ...]) -> dict[str, int]:
    """Small integer codes of a vocabulary's words (1, 2, ...), for the ring's option exchange."""
    return {word: code for code, word in enumerate(vocabulary, start=1)}


@dataclass(frozen=True)
class LossOptions:
    """The options of one loss, checked when built (:func:`check_option`, in field order).

    What :class:`hf_infcl.InfCLLoss` and ``hf_infcl.losses.InfCLLoss`` hold; the functional
    ``contrastive_loss`` takes the same options as keyword arguments. ``dataclasses.replace``
    gives a checked copy with some options changed.
    """

    loss: LossKind = "softmax"
    symmetric: bool = True
    reduction: Reduction = "mean"
    backend: BackendName | Any = "auto"  # or a block-ops object (hf_infcl.ops.spec.BlockOps)
    precision: Precision = "auto"

    def __post_init__(self):
        for option in dataclasses.fields(self):
            check_option(option.name, getattr(self, option.name))

    def as_kwargs(self) -> dict[str, Any]:
        """The options as ``contrastive_loss``'s keyword arguments."""
        return {option.name: getattr(self, option.name) for option in dataclasses.fields(self)}


class OptionAttribute:
    """An attribute of a class holding its options as ``self.options`` (a :class:`LossOptions`):
    reading it reads that option; assigning it replaces ``self.options`` with a checked copy."""

    def __set_name__(self, owner, name):
        self.name = name

    def __get__(self, obj, owner=None):
        return self if obj is None else getattr(obj.options, self.name)

    def __set__(self, obj, value):
        obj.options = dataclasses.replace(obj.options, **{self.name: value})


__all__ = [
    "BACKENDS", "BLOCK_BACKENDS", "FALSE_NEGATIVE_STRATEGIES", "GROUP_POSITIVES", "HARDNESS_MODES", "LOSSES",
    "PRECISIONS", "REDUCTIONS", "BackendName", "BlockBackend", "FalseNegativeStrategy", "GroupPositives",
    "HardnessMode", "LossKind", "LossOptions", "OptionAttribute", "Precision", "Reduction", "check_bool",
    "check_choice", "check_chunk_size", "check_chunking", "check_distillation_weight",
    "check_false_negative_margin", "check_hardness",
    "check_hardness_strength", "check_label_smoothing", "check_matryoshka", "check_matryoshka_dims",
    "check_matryoshka_weights", "check_objective_options",
    "check_option",
    "choice_error", "wire_codes",
]
