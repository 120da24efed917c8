"""Training memory from numbers alone: the arithmetic every GPU-memory tutorial does by hand.

Pure: integers in, a frozen :class:`Estimate` out (no torch, no I/O). ``gpumemd estimate`` prints it;
``gpumemd.probes.planning.trace`` puts the exact figures of a real model next to it.

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

from dataclasses import dataclass

from gpumemd.analysis.model_state import OPTIMIZERS, PRECISIONS, adafactor_state_elements, bytes_per_param, check_choice

__all__ = ["Estimate", "TransformerShape", "estimate"]

OFFLOADS: tuple[str, ...] = ("none", "optimizer", "params")
#: Nominal device sizes, in GiB (the "80 GB" of an A100/H100 is 80 GiB of HBM; H200: 141).
DEVICE_SIZES_GIB: tuple[int, ...] = (16, 24, 40, 48, 80, 141)
GIB = 1024**3


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


def activation_width(precision: str) -> int:
    """Bytes per activation element: 4 in fp32 training, 2 under any 16-bit precision."""
    check_choice("precision", precision, PRECISIONS)
    return 4 if precision == "fp32" else 2


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


def device_fits(peak: int) -> tuple[DeviceFit, ...]:
    return tuple(
        DeviceFit(name=f"{gib} GiB", capacity_bytes=gib * GIB, fits=peak <= gib * GIB,
                  headroom_bytes=gib * GIB - peak)
        for gib in DEVICE_SIZES_GIB
    )


def dominant_term(terms: dict[str, int]) -> str:
    """The largest term by bytes (ties: the first in ``terms``' order)."""
    return max(terms, key=lambda name: terms[name])


def _checked_params(params: int | None, *, precision: str, optimizer: str, gpus: int, zero_stage: int,
                    offload: str, shape: TransformerShape | None) -> int:
    """``estimate``'s arguments checked (ValueError naming the bad one); the parameter count to use."""
    check_choice("precision", precision, PRECISIONS)
    check_choice("optimizer", optimizer, OPTIMIZERS)
    check_choice("offload", offload, OFFLOADS)
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
        devices=device_fits(peak),
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


