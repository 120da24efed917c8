"""What to change after an OOM, derived from the measured breakdown (pure).

Each suggestion carries an estimated saving in bytes and the measurement that led to it. The savings
are deliberately rough rules of thumb, stated in ``why`` so a reader can judge them:
- activation checkpointing of every block keeps only block inputs: about 60% of activations saved;
- halving the micro-batch (and doubling gradient accumulation) halves activations;
- bf16 optimizer state halves fp32 Adam state; an 8-bit optimizer keeps about a quarter of it;
- ``expandable_segments`` lets the allocator grow one segment instead of leaving holes: up to all of
  the reserved-but-unallocated cache becomes usable.
"""

from __future__ import annotations

from collections.abc import Sequence

from gpumemd.analysis.breakdown import fmt
from gpumemd.records.findings import Finding
from gpumemd.records.oom import Breakdown, Suggestion

_DOMINANT = 0.20  # a share of the tensors' bytes above which a category is worth acting on
_GRAD_SHARE = 0.02
_MIN_SAVING_SHARE = 0.01  # savings under 1% of the device (and under 1 MiB) are noise, not advice
_MIN_SAVING_BYTES = 2**20


def _share(part: int, whole: int) -> str:
    return f"{100 * part / whole:.0f}%" if whole else "?"


def suggest(
    breakdown: Breakdown,
    *,
    findings: Sequence[Finding] = (),
    phase: str = "train",
    expandable_segments: bool | None = None,
) -> list[Suggestion]:
    """Suggestions, largest estimated saving first; savings under 1% of the device (or 1 MiB) are left
    out, and a request larger than the whole device gets the size check alone."""
    out: list[Suggestion] = []
    used = breakdown.tensor_bytes
    acts = breakdown.activations_bytes
    opt = breakdown.get("optimizer_state")
    grads = breakdown.get("gradients")
    graph = breakdown.get("graph_retained")
    cache = breakdown.get("reserved_unallocated")
    on_gpu = breakdown.device.startswith("cuda")

    for finding in findings:
        if finding.state != "confirmed":
            continue
        culprit = finding.culprits[0] if finding.culprits else None
        held = ""
        if culprit is not None:
            held = f"; the largest culprit is {culprit.description}"
            held += f" held by {culprit.holder}" if culprit.holder else ""
        out.append(Suggestion(
            kind="fix_leak",
            title=f"Fix the confirmed {finding.kind.replace('_', ' ')} on {finding.series}",
            saving_bytes=max(0, int(finding.growth_bytes)),
            why=f"{finding.summary} It grew {fmt(finding.growth_bytes)} since step "
                f"{finding.onset_step if finding.onset_step is not None else finding.first_step}{held}.",
            how="keep Python numbers, not tensors, across steps: total += loss.item() (or loss.detach())",
        ))
    if phase != "train" and acts > 0:
        out.append(Suggestion(
            kind="no_grad_eval",
            title=f"Run the {phase!r} phase under torch.no_grad() / torch.inference_mode()",
            saving_bytes=acts,
            why=f"The OOM happened in phase {phase!r} with {fmt(acts)} in autograd graphs and saved "
                "activations, which evaluation does not need.",
            how="with torch.inference_mode(): outputs = model(batch)",
        ))
    if used and acts / used >= _DOMINANT:
        out.append(Suggestion(
            kind="activation_checkpointing",
            title="Checkpoint activations (recompute them in backward)",
            saving_bytes=int(acts * 0.6),
            why=f"Activations and graphs are {fmt(acts)}, {_share(acts, used)} of tensor memory; "
                "checkpointing each block keeps only block inputs (about 60% saved, at ~30% more compute).",
            how="torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)",
        ))
        out.append(Suggestion(
            kind="smaller_micro_batch",
            title="Halve the micro-batch and double gradient accumulation",
            saving_bytes=acts // 2,
            why=f"Activations scale with the micro-batch: half of {fmt(acts)}, same effective batch.",
            how="batch_size //= 2; accumulate gradients over 2x the micro-batches before optimizer.step()",
        ))
    if used and opt / used >= _DOMINANT:
        out.append(Suggestion(
            kind="bf16_optimizer_state",
            title="Keep optimizer state in bf16",
            saving_bytes=opt // 2,
            why=f"Optimizer state is {fmt(opt)}, {_share(opt, used)} of tensor memory; fp32 moments in "
                "bf16 take half the bytes.",
            how="an optimizer with bf16 states (e.g. torchao's AdamW with bf16 state)",
        ))
        out.append(Suggestion(
            kind="8bit_optimizer",
            title="Use an 8-bit optimizer",
            saving_bytes=int(opt * 0.75),
            why=f"Optimizer state is {fmt(opt)}; 8-bit states keep about a quarter of fp32 state.",
            how="bitsandbytes.optim.AdamW8bit(model.parameters(), lr=...)",
        ))
    if used and grads / used >= _GRAD_SHARE:
        out.append(Suggestion(
            kind="zero_grad_set_to_none",
            title="Free gradients between steps: optimizer.zero_grad(set_to_none=True)",
            saving_bytes=grads,
            why=f"{fmt(grads)} of gradients were alive at the OOM; with set_to_none=True they are freed "
                "after the optimizer step instead of being kept as zeros through the next forward.",
            how="optimizer.zero_grad(set_to_none=True)  # right after optimizer.step()",
        ))
    if graph and used and graph / used >= 0.05 and not any(f.state == "confirmed" for f in findings):
        out.append(Suggestion(
            kind="detach_kept_tensors",
            title="Detach tensors kept across steps",
            saving_bytes=graph,
            why=f"{fmt(graph)} is held by autograd graphs of tensors that are still referenced (a loss "
                "accumulated without .item(), outputs kept in a list).",
            how="history.append(loss.item())  # not loss",
        ))
    fragmented = breakdown.verdict == "fragmentation"
    if on_gpu and cache and expandable_segments is not True and (
        fragmented or (breakdown.total_bytes and cache >= 0.1 * breakdown.total_bytes)
    ):
        largest = breakdown.largest_free_block_bytes
        out.append(Suggestion(
            kind="expandable_segments",
            title="Set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True",
            saving_bytes=cache,
            why=f"{fmt(cache)} was reserved by PyTorch but unallocated"
                + (f", and the largest free block ({fmt(largest)}) was smaller than the request"
                   if fragmented and largest is not None else "")
                + ": expandable segments grow in place instead of leaving holes.",
            how="export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True",
        ))
    floor = max(_MIN_SAVING_BYTES, int(_MIN_SAVING_SHARE * (breakdown.total_bytes or 0)))
    out = [s for s in out if s.saving_bytes >= floor]
    out.sort(key=lambda s: s.saving_bytes, reverse=True)
    if breakdown.verdict == "request_exceeds_device" and breakdown.requested_bytes is not None:
        # No saving makes a request larger than the device fit: the size is the bug.
        out = [Suggestion(
            kind="check_request_size",
            title="Check the size of the failing allocation",
            saving_bytes=breakdown.requested_bytes,
            why=breakdown.verdict_why + ". Look at the shape that produced it (a wrong view or "
                "broadcast, an unbounded sequence length, a bytes/elements mix-up).",
            how="print the shapes at the line in the traceback",
        )]
    return out
