"""What each row of ``gpumemd estimate`` is, and why it counts where it counts (``--explain``).

Pure: an :class:`Estimate` in, sentences out. The numbers come from ``analysis.memory_estimate``; this only
says, per row, how many bytes per parameter, what PyTorch holds there, and how the row enters the peak.
"""

from __future__ import annotations

from gpumemd.analysis.memory_estimate import Estimate
from gpumemd.analysis.model_state import bytes_per_param

_STATE_WORDS: dict[str, str] = {
    "sgd": "plain SGD keeps no state",
    "sgd-momentum": "SGD keeps one momentum buffer per parameter",
    "adam": "Adam keeps exp_avg and exp_avg_sq, two values per parameter",
    "adamw": "AdamW keeps exp_avg and exp_avg_sq, two values per parameter",
    "adam-8bit": "8-bit Adam keeps its two states in one byte each (bitsandbytes)",
    "adafactor": "Adafactor keeps a factored second moment, rows + columns per matrix (~0 B/param)",
    "lion": "Lion keeps one momentum per parameter",
}
_INTERMEDIATE_WORDS: dict[str, str] = {
    "adam": "torch's foreach Adam materialises sqrt(exp_avg_sq) for every parameter at once, "
            "one state-sized tensor",
    "adamw": "torch's foreach AdamW materialises sqrt(exp_avg_sq) for every parameter at once, "
             "one state-sized tensor",
    "adafactor": "Adafactor builds one update-sized tensor",
    "lion": "Lion builds one update-sized tensor",
}


def _per(value: float) -> str:
    return f"{value:g} B/param"


def _sharding(est: Estimate, term: str) -> str:
    """How sharding or offload changes ``term`` ("" when it does not)."""
    moved = {"optimizer": ("optimizer_state", "optimizer_intermediates"),
             "params": ("weights", "gradients", "optimizer_state", "optimizer_intermediates")}
    if term in moved.get(est.offload, ()):
        return " Offloaded to host memory here (--offload), so 0 on the GPU."
    first_stage = {"optimizer_state": 1, "optimizer_intermediates": 1, "gradients": 2, "weights": 3}[term]
    if est.zero_stage >= first_stage and est.gpus > 1:
        return f" Divided over the {est.gpus} GPUs (ZeRO stage {est.zero_stage})."
    return ""


def explain(est: Estimate) -> list[str]:
    """One paragraph per row of the table, then the peak's rule, as lines of text."""
    per = bytes_per_param(est.precision, est.optimizer, est.grad_dtype)
    mixed = est.precision.endswith("-mixed")
    half = "bf16" if est.precision.startswith("bf16") else "fp16"
    weights = (f"the {half} copy the forward and backward compute with (the fp32 master copy is counted "
               "in optimizer state)" if mixed else f"the parameters in {'fp32' if per.weights == 4 else half}")
    grad_dtype = est.grad_dtype or ("fp32" if per.gradients == 4 else half)
    state = _STATE_WORDS[est.optimizer] + (" (in fp32)" if mixed or est.precision == "fp32" else
                                           " (in the parameters' dtype)")
    if mixed:
        state += ", plus the fp32 master weights (4 B/param) the optimizer updates"
    inter = _INTERMEDIATE_WORDS.get(est.optimizer, f"{est.optimizer} updates in place: no temporaries")
    lines = [
        f"weights ({_per(per.weights)}): {weights}.{_sharding(est, 'weights')}",
        f"gradients ({_per(per.gradients)}): one {grad_dtype} gradient per parameter, from backward until "
        f"zero_grad (--grad-dtype sets their dtype).{_sharding(est, 'gradients')}",
        f"optimizer state ({_per(per.optimizer_state)}): {state}; alive for the whole run."
        f"{_sharding(est, 'optimizer_state')}",
        f"optimizer intermediates ({_per(per.optimizer_intermediates)}): the temporaries of one "
        f"optimizer.step(): {inter}. They exist only during the step, while the gradients are still "
        "alive and the activations already freed, so the peak adds them to the gradients, not to the "
        f"activations.{_sharding(est, 'optimizer_intermediates')}",
        "activations: what the forward saves for backward (Korthikanti et al. 2022, with --layers --hidden "
        "--heads --seq --batch); freed as backward produces the gradients.",
    ]
    if est.gather_bytes:
        lines.append("stage-3 gather buffer: the unsharded parameters of the layer being computed and of the "
                     "one prefetched (ZeRO-3 / FSDP FULL_SHARD).")
    lines.append("peak = weights + optimizer state + max(gradients + optimizer intermediates, activations): "
                 "weights and optimizer state live all along; activations peak at the end of the forward, "
                 "gradients and the optimizer's temporaries at the optimizer step, after the activations are "
                 "gone, so the larger of the two counts. Not counted: the CUDA context (0.3-2 GiB), allocator "
                 "fragmentation, communication buckets, kernel workspaces.")
    return lines
