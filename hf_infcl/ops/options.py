"""The loss's options, each defined once: its vocabulary, its check, its one error message.

Every entry point takes these options under the name its ecosystem uses (``backend`` here,
``loss_backend`` in the Trainer's arguments, ``--precision`` on an example's command line; the
table is in docs/contract.md, "Options") and checks them once, with :func:`check_option`, naming
the option as the user typed it:

    precision must be one of 'auto', 'tf32', 'ieee'; got 'fp8'

The vocabularies are ``Literal`` types, so a dataclass field typed with one gets argparse choices
from ``HfArgumentParser``, and the tuples below are derived from them (never written twice). The
ring's wire codes (:func:`wire_codes`) come from the same tuples.

The bottom of the layering: this module imports nothing from hf_infcl, so ``hf_infcl.ops`` and
everything above it can use it.
"""

from __future__ import annotations

import dataclasses
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


def check_bool(name: str, value) -> None:
    """Raise a TypeError naming ``name`` unless ``value`` is a bool (not merely truthy)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")


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
    "check_choice", "check_option", "choice_error", "wire_codes",
]
