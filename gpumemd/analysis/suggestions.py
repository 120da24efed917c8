"""What to change after an OOM, derived from the measured breakdown (pure).

Each rule is one small function from the measurements (``Facts``) to the suggestions it makes, so
each can be read and tested alone. Each suggestion carries an estimated saving in bytes and the
measurement that led to it. The savings are deliberately rough rules of thumb, stated in ``why`` so
a reader can judge them:
- fixing a leak gives back what it held at the OOM;
- activation checkpointing of every block keeps only block inputs: about 60% of activations saved;
- halving the micro-batch (and doubling gradient accumulation) halves activations;
- bf16 optimizer state halves fp32 Adam state; an 8-bit optimizer keeps about a quarter of it;
- ``expandable_segments`` lets the allocator grow one segment instead of leaving holes: up to all of
  the reserved-but-unallocated cache becomes usable.
For a capacity OOM (the request did not fit in what was left), from the request and what was free:
- a smaller batch, when the request is a whole number of rows of a census tensor (its leading
  dimension, the batch): the batch at which the request, and that tensor, fit what was left;
- chunking the operation into the fewest pieces that each fit;
- bf16 / autocast when that tensor is fp32: the request and the fp32 activations halve
  (``analysis.capacity_rules``).
A leak's autograd graphs are in the breakdown's ``leaked`` item, never in its activations: advice
sized on activations (checkpointing, a smaller micro-batch) is never sized on leaked bytes.
"""

from __future__ import annotations

from collections.abc import Sequence

from gpumemd.analysis.breakdown import fmt
from gpumemd.analysis.capacity_rules import CAPACITY_RULES
from gpumemd.analysis.leak_headline import since_words
from gpumemd.analysis.oom_leak import holder_root
from gpumemd.analysis.suggestion_facts import Facts, Rule
from gpumemd.records.census import TensorEntry
from gpumemd.records.findings import Finding
from gpumemd.records.oom import Breakdown, LeakCause, Suggestion

__all__ = ["RULES", "suggest", "why_none"]

_DOMINANT = 0.20  # a share of the tensors' bytes above which a category is worth acting on
_GRAD_SHARE = 0.02
_GRAPH_SHARE = 0.05
_CACHE_SHARE = 0.10  # reserved-but-unallocated cache worth defragmenting, as a share of the device
_MIN_SAVING_SHARE = 0.01  # savings under 1% of the device (and under 1 MiB) are noise, not advice
_MIN_SAVING_BYTES = 2**20


def _share(part: int, whole: int) -> str:
    return f"{100 * part / whole:.0f}%" if whole else "?"


def _sentence(text: str) -> str:
    """``text`` ending with a full stop, so the next sentence does not run into it."""
    text = text.rstrip()
    return text if text.endswith((".", "!", "?")) else text + "."


# --- the rules --------------------------------------------------------------------------------


def _leak_how(leak: LeakCause) -> str:
    if leak.kind == "graph_leak":
        return "keep numbers, not tensors with their graphs: total += loss.item() (or loss.detach())"
    if leak.kind == "host_leak":
        return f"bound or clear what {leak.holder} keeps every step (tracemalloc shows where it grows)"
    return (f"stop {leak.holder} from growing every step: keep .item() / .detach().cpu() copies of what "
            "you need, or bound it (collections.deque(maxlen=N))")


def fix_leak(facts: Facts) -> list[Suggestion]:
    """The leak found at the OOM: fixing it gives back everything it held."""
    leak = facts.breakdown.leak
    if leak is None:
        return []
    state = "growing" if leak.source == "census" else leak.state
    return [Suggestion(
        kind="fix_leak",
        title=f"Stop {leak.holder} from growing ({state} {leak.kind.replace('_', ' ')})",
        saving_bytes=leak.held_bytes,
        why=_sentence(leak.summary or f"{leak.holder} held {fmt(leak.held_bytes)} at the OOM"),
        how=_leak_how(leak),
    )]


def fix_confirmed_findings(facts: Facts) -> list[Suggestion]:
    """Confirmed leaks the leak at the OOM does not already cover (another holder or device)."""
    leak = facts.breakdown.leak
    covered = {holder_root(leak.holder_detail)} if leak is not None else set()
    seen_series = {leak.series} if leak is not None else set()
    out = []
    for finding in facts.findings:
        if finding.state != "confirmed" or finding.series in seen_series:
            continue
        culprit = finding.culprits[0] if finding.culprits else None
        if culprit is not None and culprit.holder and holder_root(culprit.holder) in covered:
            continue
        held = ""
        if culprit is not None:
            held = f"; the largest culprit is {culprit.description}"
            held += f" held by {culprit.holder}" if culprit.holder else ""
        since = finding.onset_step if finding.onset_step is not None else finding.first_step
        out.append(Suggestion(
            kind="fix_leak",
            title=f"Fix the confirmed {finding.kind.replace('_', ' ')} on {finding.series}",
            saving_bytes=max(0, int(finding.growth_bytes)),
            why=f"{_sentence(finding.summary)} It grew {fmt(finding.growth_bytes)} {since_words(since)}{held}.",
            how="keep Python numbers, not tensors, across steps: total += loss.item() (or loss.detach())",
        ))
    return out


def no_grad_eval(facts: Facts) -> list[Suggestion]:
    """An OOM outside training with autograd graphs alive: evaluation needs none."""
    if facts.phase == "train" or facts.acts <= 0:
        return []
    return [Suggestion(
        kind="no_grad_eval",
        title=f"Run the {facts.phase!r} phase under torch.no_grad() / torch.inference_mode()",
        saving_bytes=facts.acts,
        why=f"The OOM happened in phase {facts.phase!r} with {fmt(facts.acts)} in autograd graphs and saved "
            "activations, which evaluation does not need.",
        how="with torch.inference_mode(): outputs = model(batch)",
    )]


def activation_checkpointing(facts: Facts) -> list[Suggestion]:
    """Activations dominate: recompute them in backward instead of keeping them."""
    if facts.share(facts.acts) < _DOMINANT:
        return []
    return [Suggestion(
        kind="activation_checkpointing",
        title="Checkpoint activations (recompute them in backward)",
        saving_bytes=int(facts.acts * 0.6),
        why=f"Activations and graphs are {fmt(facts.acts)}, {_share(facts.acts, facts.used)} of tensor memory; "
            "checkpointing each block keeps only block inputs (about 60% saved, at ~30% more compute).",
        how="torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)",
    )]


def smaller_micro_batch(facts: Facts) -> list[Suggestion]:
    """Activations dominate: they scale with the micro-batch."""
    if facts.share(facts.acts) < _DOMINANT:
        return []
    return [Suggestion(
        kind="smaller_micro_batch",
        title="Halve the micro-batch and double gradient accumulation",
        saving_bytes=facts.acts // 2,
        why=f"Activations scale with the micro-batch: half of {fmt(facts.acts)}, same effective batch.",
        how="batch_size //= 2; accumulate gradients over 2x the micro-batches before optimizer.step()",
    )]


def bf16_optimizer_state(facts: Facts) -> list[Suggestion]:
    """Optimizer state dominates: bf16 moments take half the bytes of fp32 ones."""
    opt = facts.breakdown.get("optimizer_state")
    if facts.share(opt) < _DOMINANT:
        return []
    return [Suggestion(
        kind="bf16_optimizer_state",
        title="Keep optimizer state in bf16",
        saving_bytes=opt // 2,
        why=f"Optimizer state is {fmt(opt)}, {_share(opt, facts.used)} of tensor memory; fp32 moments in "
            "bf16 take half the bytes.",
        how="an optimizer with bf16 states (e.g. torchao's AdamW with bf16 state)",
    )]


def eight_bit_optimizer(facts: Facts) -> list[Suggestion]:
    """Optimizer state dominates: 8-bit states keep about a quarter of fp32 state."""
    opt = facts.breakdown.get("optimizer_state")
    if facts.share(opt) < _DOMINANT:
        return []
    return [Suggestion(
        kind="8bit_optimizer",
        title="Use an 8-bit optimizer",
        saving_bytes=int(opt * 0.75),
        why=f"Optimizer state is {fmt(opt)}; 8-bit states keep about a quarter of fp32 state.",
        how="bitsandbytes.optim.AdamW8bit(model.parameters(), lr=...)",
    )]


def zero_grad_set_to_none(facts: Facts) -> list[Suggestion]:
    """Gradients alive at the OOM: set_to_none frees them between steps."""
    grads = facts.breakdown.get("gradients")
    if facts.share(grads) < _GRAD_SHARE:
        return []
    return [Suggestion(
        kind="zero_grad_set_to_none",
        title="Free gradients between steps: optimizer.zero_grad(set_to_none=True)",
        saving_bytes=grads,
        why=f"{fmt(grads)} of gradients were alive at the OOM; with set_to_none=True they are freed "
            "after the optimizer step instead of being kept as zeros through the next forward.",
        how="optimizer.zero_grad(set_to_none=True)  # right after optimizer.step()",
    )]


def detach_kept_tensors(facts: Facts) -> list[Suggestion]:
    """Graphs kept alive by referenced tensors, when no leak finding already names them."""
    graph = facts.breakdown.get("graph_retained")
    named = facts.breakdown.leak is not None or any(f.state == "confirmed" for f in facts.findings)
    if named or facts.share(graph) < _GRAPH_SHARE:
        return []
    return [Suggestion(
        kind="detach_kept_tensors",
        title="Detach tensors kept across steps",
        saving_bytes=graph,
        why=f"{fmt(graph)} is held by autograd graphs of tensors that are still referenced (a loss "
            "accumulated without .item(), outputs kept in a list).",
        how="history.append(loss.item())  # not loss",
    )]


def expandable_segments(facts: Facts) -> list[Suggestion]:
    """Free memory in pieces, or a large cache, on a CUDA device without expandable segments."""
    b = facts.breakdown
    cache = b.get("reserved_unallocated")
    fragmented = b.verdict == "fragmentation"
    large = bool(b.total_bytes) and cache >= _CACHE_SHARE * (b.total_bytes or 0)
    if b.device.cuda_index is None or not cache or facts.expandable_segments is True or not (fragmented or large):
        return []
    largest = b.largest_free_block_bytes
    return [Suggestion(
        kind="expandable_segments",
        title="Set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True",
        saving_bytes=cache,
        why=f"{fmt(cache)} was reserved by PyTorch but unallocated"
            + (f", and the largest free block ({fmt(largest)}) was smaller than the request"
               if fragmented and largest is not None else "")
            + ": expandable segments grow in place instead of leaving holes.",
        how="export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True",
    )]


def check_request_size(facts: Facts) -> list[Suggestion]:
    """A request larger than the whole device: no saving makes it fit, the size is the bug."""
    b = facts.breakdown
    if b.verdict != "request_exceeds_device" or b.requested_bytes is None:
        return []
    return [Suggestion(
        kind="check_request_size",
        title="Check the size of the failing allocation",
        saving_bytes=b.requested_bytes,
        why=_sentence(b.verdict_why) + " Look at the shape that produced it (a wrong view or "
            "broadcast, an unbounded sequence length, a bytes/elements mix-up).",
        how="print the shapes at the line in the traceback",
    )]


RULES: tuple[Rule, ...] = (
    fix_leak, fix_confirmed_findings, no_grad_eval, activation_checkpointing, smaller_micro_batch,
    bf16_optimizer_state, eight_bit_optimizer, zero_grad_set_to_none, detach_kept_tensors, expandable_segments,
    *CAPACITY_RULES,
)


def suggest(
    breakdown: Breakdown,
    *,
    findings: Sequence[Finding] = (),
    phase: str = "train",
    expandable_segments: bool | None = None,
    largest: Sequence[TensorEntry] = (),
) -> list[Suggestion]:
    """Suggestions, largest estimated saving first, except that the fix of a leak the verdict blames
    comes first; savings under 1% of the device (or 1 MiB) are left out. A request larger than the
    whole device gets the size check, followed only by the fix of a leak at the OOM."""
    facts = Facts(breakdown, findings, phase, expandable_segments, largest)
    floor = max(_MIN_SAVING_BYTES, int(_MIN_SAVING_SHARE * (breakdown.total_bytes or 0)))
    size_bug = check_request_size(facts)
    if size_bug:
        return size_bug + [s for s in fix_leak(facts) if s.saving_bytes >= floor]
    blamed = breakdown.verdict == "leak"
    made = [(rule, s) for rule in RULES for s in rule(facts) if s.saving_bytes >= floor]
    made.sort(key=lambda made: (blamed and made[0] is fix_leak, made[1].saving_bytes), reverse=True)
    return [s for _, s in made]


def why_none(breakdown: Breakdown) -> str:
    """Why no rule made a suggestion, from the same measurements (printed in place of the advice)."""
    b = breakdown
    used = b.tensor_bytes
    shares = ", ".join(f"{label} {_share(part, used)}" for label, part in (
        ("activations", b.activations_bytes), ("optimizer state", b.get("optimizer_state")),
        ("gradients", b.get("gradients"))))
    return (f"No suggestion: no rule applies. The verdict is {b.verdict} ({b.verdict_why.rstrip('.')}); no leak "
            f"was active; of the {fmt(used)} in tensors {shares}, none over the {_DOMINANT:.0%} worth acting "
            f"on; {fmt(b.get('reserved_unallocated'))} was cached and unallocated.")
