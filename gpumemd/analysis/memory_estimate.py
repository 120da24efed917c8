"""Training memory from numbers alone: the arithmetic every GPU-memory tutorial does by hand.

Pure: integers in, a frozen :class:`Estimate` out (no torch, no I/O). ``gpumemd estimate`` prints it;
``gpumemd.probes.trace`` puts the exact figures of a real model next to it.

The model (all figures per GPU, in bytes)
------------------------------------------
**Model state, bytes per parameter** (Rajbhandari et al., "ZeRO: Memory Optimizations Toward
Training Trillion Parameter Models", SC'20, §3.1: mixed-precision Adam needs ``2Ψ + 2Ψ + KΨ`` with
``K = 12``, i.e. 16 bytes/parameter, "a 7.5B model needs 120 GB")::

    precision      weights  grads  optimizer state (master fp32 copy + per-optimizer state)
    fp32              4       4     S                      S: sgd 0, sgd-momentum 4, adam/adamw 8,
    bf16-/fp16-mixed  2       2     4 + S                     adam-8bit 2, lion 4, adafactor ~0
    bf16 / fp16       2       2     S / 2 (state kept in the parameter dtype, as torch.optim does)

Hugging Face's "Model training anatomy" (huggingface.co/docs/transformers/model_memory_anatomy)
books mixed precision as 6 (fp32 + half weights) + 4 (fp32 grads) + 8 = 18 bytes/parameter; the
ZeRO layout above (half weights and grads on the GPU, fp32 master weights with the optimizer) is the
one ZeRO/FSDP shard, so it is the one used here. PyTorch autocast (fp32 weights and grads, half
activations) lands on the same 16 bytes/parameter with Adam.

8-bit Adam follows bitsandbytes (two uint8 states, 2 bytes/parameter; block constants ignored).
Adafactor (Shazeer & Stern 2018) keeps a factored second moment of ``rows + cols`` floats per
matrix: ~0 bytes/parameter; when a transformer shape is given it is counted per matrix.
Lion (Chen et al. 2023) keeps one momentum.

**Optimizer intermediates**: the temporaries of one ``optimizer.step()``. torch's foreach Adam/AdamW
materialises ``sqrt(exp_avg_sq)`` for all parameters at once (one state-sized tensor); Lion and
Adafactor build one update-sized tensor; SGD (with or without momentum) and bitsandbytes' fused
8-bit kernels update in place (0).

**Sharding** (ZeRO stages; FSDP ``NO_SHARD``/``SHARD_GRAD_OP``/``FULL_SHARD`` = stages 0/2/3), over
``N`` GPUs: stage >= 1 divides optimizer state and intermediates by N, stage >= 2 also gradients,
stage 3 also weights (ZeRO §5, Figure 1: 7.5B on 64 GPUs → 120, 31.4, 16.6, 1.9 GB). Stage 3
needs the unsharded parameters of the layers being computed: two layers (one prefetched) are
counted when a transformer shape is given. **CPU offload** ("optimizer": ZeRO-Offload; "params":
ZeRO-3 / FSDP ``CPUOffload(offload_params=True)``) moves those terms to host memory.

**Activations** of a transformer (Korthikanti et al., "Reducing Activation Recomputation in Large
Transformer Models", MLSys'23, eq. 1, no tensor/sequence parallelism), per layer::

    s·b·h·(34 + 5·a·s/h)   bytes with 16-bit activations and 1-byte dropout masks

generalised to an activation width of ``w`` bytes as ``s·b·h·(16w + 2) + a·s²·b·(2w + 1)``
(w = 2 gives eq. 1 exactly). Flash attention stores no ``s²`` tensors, only a fp32 log-sum-exp
(``4·a·s·b``). Full activation checkpointing keeps each layer's 16-bit input (``2·s·b·h``) plus one
layer's activations while it is recomputed. With a vocabulary the logits and the fp32
log-softmax the loss saves add ``s·b·V·(w + 4)``.

**Peak** (the Hugging Face rule)::

    peak = weights + optimizer state + max(gradients + optimizer intermediates, activations)
           (+ the stage-3 gather buffer)

Activations are freed as backward produces gradients, and the optimizer step runs after they are
gone, so the two never peak together. Not modelled: the CUDA context (0.3–2 GiB, not allocator
memory), allocator fragmentation, communication buckets, kernel workspaces.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

PRECISIONS: tuple[str, ...] = ("fp32", "bf16-mixed", "fp16-mixed", "bf16", "fp16")
OPTIMIZERS: tuple[str, ...] = ("sgd", "sgd-momentum", "adam", "adamw", "adam-8bit", "adafactor", "lion")
OFFLOADS: tuple[str, ...] = ("none", "optimizer", "params")
GRAD_DTYPES: dict[str, int] = {"fp32": 4, "bf16": 2, "fp16": 2}
"""Gradient dtypes ``grad_dtype`` takes, and their bytes (default: the precision's, 4 in fp32, else 2)."""
#: Nominal device sizes, in GiB (the "80 GB" of an A100/H100 is 80 GiB of HBM; H200: 141).
DEVICE_SIZES_GIB: tuple[int, ...] = (16, 24, 40, 48, 80, 141)
GIB = 1024**3

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
# Temporaries of one optimizer step, in units of "one state-dtype copy of the parameters".
_INTERMEDIATE_COPIES: dict[str, float] = {
    "sgd": 0.0,
    "sgd-momentum": 0.0,
    "adam": 1.0,
    "adamw": 1.0,
    "adam-8bit": 0.0,
    "adafactor": 1.0,
    "lion": 1.0,
}
TERMS: tuple[str, ...] = ("weights", "gradients", "optimizer_state", "optimizer_intermediates", "activations")


@dataclass(frozen=True, slots=True)
class BytesPerParam:
    """Model-state bytes per parameter, before sharding."""

    weights: float
    gradients: float
    optimizer_state: float  # includes fp32 master weights under mixed precision
    optimizer_intermediates: float

    @property
    def model_state(self) -> float:
        return self.weights + self.gradients + self.optimizer_state


@dataclass(frozen=True, slots=True)
class TransformerShape:
    """A GPT-style decoder: ``layers`` blocks of attention + 4h MLP; ``batch`` is per GPU."""

    layers: int
    hidden: int
    heads: int
    seq: int
    batch: int
    vocab: int = 0
    flash: bool = False
    checkpointing: bool = False

    def __post_init__(self) -> None:
        for name in ("layers", "hidden", "heads", "seq", "batch"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"transformer {name}={value!r} is not valid: expected an integer >= 1")
        if self.vocab < 0:
            raise ValueError(f"transformer vocab={self.vocab!r} is not valid: expected an integer >= 0")
        if self.hidden % self.heads:
            raise ValueError(
                f"transformer hidden={self.hidden} is not divisible by heads={self.heads}: "
                "each head gets hidden/heads dimensions; pick heads that divide hidden"
            )

    @property
    def parameters(self) -> int:
        """``12·L·h² + 13·L·h`` (attention, MLP, biases, 2 LayerNorms) ``+ V·h + s·h`` (embeddings).

        The standard count (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training
        on GPU Clusters", §5.1), with a tied output head.
        """
        h = self.hidden
        return self.layers * (12 * h * h + 13 * h) + self.vocab * h + self.seq * h + 2 * h


@dataclass(frozen=True, slots=True)
class DeviceFit:
    name: str
    capacity_bytes: int
    fits: bool
    headroom_bytes: int  # capacity - peak (negative when it does not fit)


@dataclass(frozen=True, slots=True)
class Estimate:
    """Per-GPU breakdown and peak; ``host_bytes`` is what CPU offload keeps in host memory."""

    params: int
    precision: str
    optimizer: str
    gpus: int
    zero_stage: int
    offload: str
    weights_bytes: int
    gradients_bytes: int
    optimizer_state_bytes: int
    optimizer_intermediates_bytes: int
    activations_bytes: int | None  # None: no transformer shape given
    gather_bytes: int  # stage-3 unsharded working set (0 when not sharded or shape unknown)
    host_bytes: int
    peak_bytes: int
    dominant: str
    devices: tuple[DeviceFit, ...]
    shape: TransformerShape | None = None
    grad_dtype: str | None = None  # the gradients' dtype when given (None: the precision's)

    @property
    def before_activations_bytes(self) -> int:
        """Weights + gradients + optimizer state: the headline figure before any activation (16 B/param
        for mixed-precision AdamW: 112 GB for 7B parameters)."""
        return self.weights_bytes + self.gradients_bytes + self.optimizer_state_bytes

    def terms(self) -> dict[str, int]:
        """The per-GPU terms by name (activations 0 when unknown)."""
        return {
            "weights": self.weights_bytes,
            "gradients": self.gradients_bytes,
            "optimizer_state": self.optimizer_state_bytes,
            "optimizer_intermediates": self.optimizer_intermediates_bytes,
            "activations": self.activations_bytes or 0,
            "gather_buffer": self.gather_bytes,
        }


def _check_choice(name: str, value: str, choices: Sequence[str]) -> None:
    if value not in choices:
        raise ValueError(f"{name}={value!r} is not valid: expected one of {', '.join(choices)}")


def activation_width(precision: str) -> int:
    """Bytes per activation element: 4 in fp32 training, 2 under any 16-bit precision."""
    _check_choice("precision", precision, PRECISIONS)
    return 4 if precision == "fp32" else 2


def bytes_per_param(precision: str, optimizer: str, grad_dtype: str | None = None) -> BytesPerParam:
    """The table in the module docstring, for one precision and optimizer; ``grad_dtype`` sets the
    gradients' dtype when it is not the precision's (fp32 gradients with bf16 parameters, as with
    FSDP's ``MixedPrecision(reduce_dtype=torch.float32)`` or a gradient accumulation kept in fp32)."""
    per = _bytes_per_param(precision, optimizer)
    if grad_dtype is None:
        return per
    _check_choice("grad_dtype", grad_dtype, tuple(GRAD_DTYPES))
    return BytesPerParam(per.weights, float(GRAD_DTYPES[grad_dtype]), per.optimizer_state, per.optimizer_intermediates)


def _bytes_per_param(precision: str, optimizer: str) -> BytesPerParam:
    _check_choice("precision", precision, PRECISIONS)
    _check_choice("optimizer", optimizer, OPTIMIZERS)
    state = _STATE_FP32[optimizer]
    copies = _INTERMEDIATE_COPIES[optimizer]
    if precision == "fp32":
        return BytesPerParam(4.0, 4.0, state, 4.0 * copies)
    if precision.endswith("-mixed"):
        # fp32 master weights live with the optimizer (and are sharded with it); state is fp32.
        return BytesPerParam(2.0, 2.0, 4.0 + state, 4.0 * copies)
    # Pure 16-bit: torch.optim keeps state in the parameter dtype; 8-bit Adam stays 1 byte/state.
    pure_state = state if optimizer == "adam-8bit" else state / 2
    return BytesPerParam(2.0, 2.0, pure_state, 2.0 * copies)


def adafactor_state_elements(shapes: Iterable[Sequence[int]]) -> int:
    """Adafactor's factored second moment: ``rows + cols`` for >=2-D tensors, ``numel`` otherwise
    (what ``torch.optim.Adafactor`` allocates as row_var/col_var or variance)."""
    total = 0
    for shape in shapes:
        if len(shape) >= 2:
            lead = math.prod(shape[:-2])
            total += lead * (shape[-2] + shape[-1])
        else:
            total += math.prod(shape)
    return total


def transformer_matrix_shapes(shape: TransformerShape) -> list[tuple[int, ...]]:
    """The weight matrices of ``shape`` (for Adafactor's factored state and gather buffers)."""
    h = shape.hidden
    per_layer: list[tuple[int, ...]] = [(3 * h, h), (h, h), (4 * h, h), (h, 4 * h)]
    mats = per_layer * shape.layers
    if shape.vocab:
        mats.append((shape.vocab, h))
    mats.append((shape.seq, h))
    return mats


def transformer_activation_bytes(shape: TransformerShape, precision: str) -> int:
    """Bytes saved for backward by one micro-batch (Korthikanti et al. 2022, eq. 1; see module doc)."""
    w = activation_width(precision)
    s, b, h, a, n = shape.seq, shape.batch, shape.hidden, shape.heads, shape.layers
    linear = s * b * h * (16 * w + 2)
    quadratic = 4 * a * s * b if shape.flash else a * s * s * b * (2 * w + 1)
    per_layer = linear + quadratic
    layers = 2 * s * b * h * n + per_layer if shape.checkpointing else per_layer * n
    logits = s * b * shape.vocab * (w + 4)
    return layers + logits


def peak_bytes(
    weights: int, optimizer_state: int, gradients: int, intermediates: int, activations: int, *, gather: int = 0
) -> int:
    """``weights + optimizer state + max(gradients + intermediates, activations) + gather``."""
    return weights + optimizer_state + max(gradients + intermediates, activations) + gather


def device_fits(peak: int, sizes_gib: Sequence[int] = DEVICE_SIZES_GIB) -> tuple[DeviceFit, ...]:
    return tuple(
        DeviceFit(name=f"{gib} GiB", capacity_bytes=gib * GIB, fits=peak <= gib * GIB,
                  headroom_bytes=gib * GIB - peak)
        for gib in sizes_gib
    )


def dominant_term(terms: dict[str, int]) -> str:
    """The largest term by bytes (ties: the first in ``TERMS`` order)."""
    return max(terms, key=lambda name: terms[name])


def _checked_params(params: int | None, *, precision: str, optimizer: str, gpus: int, zero_stage: int,
                    offload: str, shape: TransformerShape | None) -> int:
    """``estimate``'s arguments checked (ValueError naming the bad one); the parameter count to use."""
    _check_choice("precision", precision, PRECISIONS)
    _check_choice("optimizer", optimizer, OPTIMIZERS)
    _check_choice("offload", offload, OFFLOADS)
    if params is None:
        if shape is None or not shape.vocab:
            raise ValueError("params is missing: give a parameter count, or a transformer shape with a vocab")
        params = shape.parameters
    if not isinstance(params, int) or params < 1:
        raise ValueError(f"params={params!r} is not valid: expected a parameter count >= 1")
    if not isinstance(gpus, int) or gpus < 1:
        raise ValueError(f"gpus={gpus!r} is not valid: expected an integer >= 1")
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage={zero_stage!r} is not valid: expected 0, 1, 2 or 3")
    if offload == "params" and zero_stage != 3:
        raise ValueError(
            f"offload='params' needs zero_stage=3 (got {zero_stage}): parameters are offloaded only "
            "when they are sharded (ZeRO-3 / FSDP FULL_SHARD)"
        )
    if offload == "optimizer" and zero_stage == 0 and gpus > 1:
        raise ValueError("offload='optimizer' needs zero_stage >= 1 with several GPUs (ZeRO-Offload)")
    return params


def estimate(
    params: int | None = None,
    *,
    precision: str = "fp32",
    optimizer: str = "adamw",
    gpus: int = 1,
    zero_stage: int = 0,
    offload: str = "none",
    shape: TransformerShape | None = None,
    sizes_gib: Sequence[int] = DEVICE_SIZES_GIB,
    grad_dtype: str | None = None,
) -> Estimate:
    """Per-GPU memory of one training step; ``params`` defaults to the shape's parameter count;
    ``grad_dtype`` (fp32, bf16, fp16) when the gradients are not in the precision's dtype."""
    params = _checked_params(params, precision=precision, optimizer=optimizer, gpus=gpus, zero_stage=zero_stage,
                             offload=offload, shape=shape)
    per = bytes_per_param(precision, optimizer, grad_dtype)
    weights = per.weights * params
    grads = per.gradients * params
    state = per.optimizer_state * params
    inter = per.optimizer_intermediates * params
    if optimizer == "adafactor" and shape is not None:
        state_width = 4 if precision == "fp32" or precision.endswith("-mixed") else 2
        state += state_width * adafactor_state_elements(transformer_matrix_shapes(shape))

    weights, grads, state, inter, host = _partitioned(weights, grads, state, inter, zero_stage=zero_stage,
                                                      gpus=gpus, offload=offload)
    gather = 0
    if zero_stage == 3 and gpus > 1 and shape is not None:
        h = shape.hidden
        gather = int(2 * (12 * h * h + 13 * h) * per.weights)  # this layer + the prefetched one

    acts = transformer_activation_bytes(shape, precision) if shape is not None else None
    w_i, g_i, s_i, i_i = int(weights), int(grads), int(state), int(inter)
    peak = peak_bytes(w_i, s_i, g_i, i_i, acts or 0, gather=gather)
    terms = {"weights": w_i, "gradients": g_i, "optimizer_state": s_i, "optimizer_intermediates": i_i}
    if acts is not None:
        terms["activations"] = acts
    return Estimate(
        params=params,
        precision=precision,
        optimizer=optimizer,
        gpus=gpus,
        zero_stage=zero_stage,
        offload=offload,
        weights_bytes=w_i,
        gradients_bytes=g_i,
        optimizer_state_bytes=s_i,
        optimizer_intermediates_bytes=i_i,
        activations_bytes=acts,
        gather_bytes=gather,
        host_bytes=host,
        peak_bytes=peak,
        dominant=dominant_term(terms),
        devices=device_fits(peak, sizes_gib),
        shape=shape,
        grad_dtype=grad_dtype,
    )


def _partitioned(weights: float, grads: float, state: float, inter: float, *, zero_stage: int, gpus: int,
                 offload: str) -> tuple[float, float, float, float, int]:
    """Each GPU's share of the model state under ZeRO (stage 1 shards the optimizer, 2 the gradients
    too, 3 the weights too), and what offloading moves to the host: (weights, gradients, optimizer
    state, optimizer intermediates, host bytes)."""
    if zero_stage >= 1:
        state, inter = state / gpus, inter / gpus
    if zero_stage >= 2:
        grads = grads / gpus
    if zero_stage == 3:
        weights = weights / gpus
    host = 0
    if offload in ("optimizer", "params"):
        host += int(state + inter)
        state = inter = 0
    if offload == "params":
        host += int(weights + grads)
        weights = grads = 0
    return weights, grads, state, inter, host


# --- exact model-state bytes of a real model (used by probes.trace; pure over shapes) ------------


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
    _check_choice("optimizer", optimizer, OPTIMIZERS)
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
    _check_choice("optimizer", optimizer, OPTIMIZERS)
    copies = _INTERMEDIATE_COPIES[optimizer]
    return int(copies * sum(p.nbytes for p in params))
