"""Model-state bytes per parameter: weights, gradients and optimizer state (pure: no torch, no I/O).

Counted two ways: per parameter, for a precision and an optimizer (the table ``analysis.memory_estimate``
sets out in its docstring, which ``estimate`` multiplies by a parameter count), and exactly, as what
``torch.optim`` allocates for the parameters of a real model (``probes.planning.trace``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

PRECISIONS: tuple[str, ...] = ("fp32", "bf16-mixed", "fp16-mixed", "bf16", "fp16")
OPTIMIZERS: tuple[str, ...] = ("sgd", "sgd-momentum", "adam", "adamw", "adam-8bit", "adafactor", "lion")
GRAD_DTYPES: dict[str, int] = {"fp32": 4, "bf16": 2, "fp16": 2}
"""Gradient dtypes ``grad_dtype`` takes, and their bytes (default: the precision's, 4 in fp32, else 2)."""

# Per-optimizer state, bytes per parameter, when the state is kept in fp32.
_STATE_FP32: dict[str, float] = {
    "sgd": 0.0,
    "sgd-momentum": 4.0,
    "adam": 8.0,
    "adamw": 8.0,
    "adam-8bit": 2.0,  # two uint8 states, whatever the parameter dtype
    "adafactor": 0.0,  # factored: O(rows + cols) per matrix, see adafactor_state_elements
    "lion": 4.0,
}
# Optimizers whose step builds one state-dtype copy of the parameters as temporaries; the others
# (SGD with or without momentum, bitsandbytes' fused 8-bit kernels) update in place.
_ONE_TEMPORARY_COPY = frozenset({"adam", "adamw", "adafactor", "lion"})


@dataclass(frozen=True, slots=True)
class BytesPerParam:
    """Model-state bytes per parameter, before sharding."""

    weights: float
    gradients: float
    optimizer_state: float  # includes fp32 master weights under mixed precision
    optimizer_intermediates: float


def check_choice(name: str, value: str, choices: Sequence[str]) -> None:
    if value not in choices:
        raise ValueError(f"{name}={value!r} is not valid: expected one of {', '.join(choices)}")


def bytes_per_param(precision: str, optimizer: str, grad_dtype: str | None = None) -> BytesPerParam:
    """The table in ``analysis.memory_estimate``'s docstring, for one precision and optimizer;
    ``grad_dtype`` sets the gradients' dtype when it is not the precision's (fp32 gradients with bf16
    parameters, as with FSDP's ``MixedPrecision(reduce_dtype=torch.float32)`` or a gradient
    accumulation kept in fp32)."""
    check_choice("precision", precision, PRECISIONS)
    check_choice("optimizer", optimizer, OPTIMIZERS)
    state = _STATE_FP32[optimizer]
    copies = 1.0 if optimizer in _ONE_TEMPORARY_COPY else 0.0
    if precision == "fp32":
        per = BytesPerParam(4.0, 4.0, state, 4.0 * copies)
    elif precision.endswith("-mixed"):
        # fp32 master weights live with the optimizer (and are sharded with it); state is fp32.
        per = BytesPerParam(2.0, 2.0, 4.0 + state, 4.0 * copies)
    else:
        # Pure 16-bit: torch.optim keeps state in the parameter dtype; 8-bit Adam stays 1 byte/state.
        per = BytesPerParam(2.0, 2.0, state if optimizer == "adam-8bit" else state / 2, 2.0 * copies)
    if grad_dtype is None:
        return per
    check_choice("grad_dtype", grad_dtype, tuple(GRAD_DTYPES))
    return dataclasses.replace(per, gradients=float(GRAD_DTYPES[grad_dtype]))


def adafactor_state_elements(shapes: Iterable[Sequence[int]]) -> int:
    """Adafactor's factored second moment: ``rows + cols`` for >=2-D tensors, ``numel`` otherwise
    (what ``torch.optim.Adafactor`` allocates as row_var/col_var or variance)."""
    return sum(math.prod(shape[:-2]) * (shape[-2] + shape[-1]) if len(shape) >= 2 else math.prod(shape)
               for shape in shapes)


@dataclass(frozen=True, slots=True)
class ParamInfo:
    """One unique parameter: its shape and element size in bytes."""

    shape: tuple[int, ...]
    itemsize: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize


STEP_TENSOR_BYTES = 4  # torch.optim keeps `step` as a 0-d float32 tensor per parameter (Adam, Adafactor)


def optimizer_state_bytes(params: Iterable[ParamInfo], optimizer: str) -> int:
    """What ``torch.optim`` allocates as state for these parameters after the first step.

    sgd: nothing; sgd-momentum: ``momentum_buffer``; adam/adamw: ``exp_avg``, ``exp_avg_sq`` and a
    0-d fp32 ``step``; adafactor: ``row_var``/``col_var`` (or ``variance`` for 1-D) and ``step``;
    lion (lion-pytorch): ``exp_avg``; adam-8bit (bitsandbytes defaults): two uint8 states plus one
    fp32 absmax per 256-element block each, fp32 states for tensors under 4096 elements.
    """
    check_choice("optimizer", optimizer, OPTIMIZERS)
    total = 0
    for p in params:
        if optimizer in {"sgd-momentum", "lion"}:
            total += p.nbytes
        elif optimizer in ("adam", "adamw"):
            total += 2 * p.nbytes + STEP_TENSOR_BYTES
        elif optimizer == "adafactor":
            total += adafactor_state_elements([p.shape]) * p.itemsize + STEP_TENSOR_BYTES
        elif optimizer == "adam-8bit":
            if p.numel < 4096:
                total += 2 * 4 * p.numel + STEP_TENSOR_BYTES
            else:
                blocks = -(-p.numel // 256)
                total += 2 * p.numel + 2 * 4 * blocks + STEP_TENSOR_BYTES
    return total


def optimizer_intermediate_bytes(params: Iterable[ParamInfo], optimizer: str) -> int:
    """One parameter-sized temporary per parameter for Adam/AdamW/Adafactor/Lion, else 0."""
    check_choice("optimizer", optimizer, OPTIMIZERS)
    copies = 1.0 if optimizer in _ONE_TEMPORARY_COPY else 0.0
    return int(copies * sum(p.nbytes for p in params))
