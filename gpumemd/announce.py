"""The two lines gpumemd says about itself: what it watches when it starts, and what it saw at exit.

A newcomer who types ``gpumemd run train.py`` must see where the output goes, where the metrics are
served, which devices are watched and which probes are absent and why; at exit, how many steps,
what was found, which reports were written and what the agent cost. The wording is pure (tested
on data); ``emit`` is the only I/O: through the ``gpumemd.status`` logger when the job configured
logging (so the line lands where its other logs go), else straight to stderr, as the CLI does.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from gpumemd.analysis.holder_adds import UNTIL_RESET
from gpumemd.analysis.leak_headline import mention
from gpumemd.records.findings import Finding, live_worst_first
from gpumemd.records.step import AgentState, Overhead, ending_words

status_log = logging.getLogger("gpumemd.status")


@dataclass(frozen=True)
class StartFacts:
    """What the start line reports; gathered by the agent once its components are up."""

    pid: int
    rank: int
    world_size: int
    output_dir: str
    metrics_url: str | None
    devices: Sequence[str]  # e.g. ("cuda:0",) or () on a CPU-only job
    absent: Mapping[str, str]  # probe name -> why it is absent on this machine


def start_line(facts: StartFacts) -> str:
    where = f"pid {facts.pid}" + (f", rank {facts.rank}/{facts.world_size}" if facts.world_size > 1 else "")
    devices = ", ".join(facts.devices) if facts.devices else "host memory only (no CUDA device in use)"
    metrics = facts.metrics_url or "off (set --port or GPUMEMD_PORT to serve Prometheus metrics)"
    parts = [
        f"gpumemd: watching {where}",
        f"output {facts.output_dir}",
        f"metrics {metrics}",
        f"devices: {devices}",
    ]
    if facts.absent:
        parts.append("absent: " + "; ".join(f"{name}: {why}" for name, why in sorted(facts.absent.items())))
    return " · ".join(parts)


def exit_summary(state: AgentState, output_dir: str, *, recent: tuple[int, float] | None = None) -> str:
    """One line at detach: steps, findings, OOM reports, the agent's share of the job's time (and of
    its last steps: ``recent``, (steps, share), from ``StepEnds.recent``)."""
    overhead = state.overhead
    steps = state.steps_total
    parts = [f"gpumemd: {steps:,} step{'s' if steps != 1 else ''} watched in {_duration(overhead.wall_seconds)}"]
    if state.ended not in (None, "exit", "exit:0"):  # the ordinary endings go without saying
        parts[0] = f"gpumemd: {ending_words(state.ended)} · " + parts[0].removeprefix("gpumemd: ")
    parts.append(_findings_text(state.findings))
    if state.ooms_caught:
        parts.append(caught_text(state.ooms_caught, state.oom_caught_steps))
    if state.reports:
        parts.append(f"{len(state.reports)} OOM report{'s' if len(state.reports) > 1 else ''}: "
                     + ", ".join(state.reports))
    elif state.ooms_total:
        parts.append(f"{state.ooms_total} OOM{'s' if state.ooms_total > 1 else ''}, no report written")
    else:
        parts.append("no OOM")
    parts.append(_cost_text(overhead, recent))
    if state.findings or state.reports:
        parts.append(f"output {output_dir}")
    nxt = next_text(state, output_dir)
    return " · ".join(parts) + (f" · {nxt}" if nxt else "")


# The fix of each kind of finding in a few words (the findings file's sentence says it in full).
FIX_WORDS: dict[str, str] = {
    "graph_leak": "keep loss.item() or .detach(), not the tensor with its graph",
    "tensor_leak": "keep .detach().cpu() copies, or bound what holds them (a deque(maxlen=N))",
    "host_leak": "bound or clear the container that grows every step",
    "fragmentation": "try PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True",
    "non_pytorch": "look at what allocates outside PyTorch (NCCL, a library, another process)",
}


def fix_words(finding: Finding) -> str:
    """The fix of ``finding`` in a few words. A retained graph kept by a scalar is a loss kept whole
    (``loss.item()``); by anything larger, predictions computed with autograd on (evaluation without
    ``torch.no_grad()``), whose graph nothing will ever need. Scalar tensors kept without a graph are
    numbers kept as tensors (``.item()``)."""
    group = finding.group or finding.series
    if any(UNTIL_RESET in (c.holder or "") for c in finding.culprits):
        return "call the metric's reset() after compute(), each epoch: it keeps every update() until then"
    if any(", queued at " in (c.holder or "") for c in finding.culprits):
        # A queue's consumer (an uploader thread) falls behind the steps: a deque is not the fix.
        return "the queue's consumer falls behind: bound it (Queue(maxsize=N)) or put .item() numbers, not tensors"
    if finding.kind == "graph_leak" and "with grad_fn" in group and "[]" not in group:
        return "compute what you keep under torch.no_grad(), or keep its .detach()"
    if finding.kind == "tensor_leak" and "[]" in group:
        # Scalars kept as tensors (``history.append(loss.detach())``): a detached CPU copy is what is
        # kept already; the number is what is wanted.
        return "keep .item() of each, not the tensor, or bound what holds them (a deque(maxlen=N))"
    if finding.kind == "host_leak":
        top = finding.culprits[0] if finding.culprits else None
        if top is not None and top.category == "workers":
            return "bound what the Dataset caches in each worker; hold numpy arrays, not Python lists (copy-on-read)"
        if top is None or not top.holder:  # no Python container grew with it: a container is not the fix
            return "look outside Python objects: a C extension's or a native library's allocations grow"
    return FIX_WORDS.get(finding.kind, "stop what grows")


def next_text(state: AgentState, output_dir: str) -> str | None:
    """What to do next, last on the exit line: the fix of the worst live finding in a few words, or
    the OOM to read, and the command that shows it all."""
    live = live_worst_first(state.findings)
    see = f"gpumemd report {output_dir}"
    if live:
        return f"next: {fix_words(live[0])}; then {see}"
    if state.reports or state.ooms_total:
        return f"next: {see}"
    return None


def caught_text(count: int, steps: Sequence[int]) -> str:
    """"3 OOMs caught by the job, at steps 12, 40 and 41": the OOMs it went on from, which recur."""
    where = ", ".join(f"{s:,}" for s in steps[:-1]) + (" and " if len(steps) > 1 else "") + (
        f"{steps[-1]:,}" if steps else "")
    at = f", at step{'s' if len(steps) > 1 else ''} {where}" if steps else ""
    return f"{count} OOM{'s' if count > 1 else ''} caught by the job{at}"


def _findings_text(findings: Sequence[Finding]) -> str:
    """Each live finding named once, short: the WARNING line said the rest, and the sizes it saw
    are stale by now (the findings file and ``gpumemd report`` keep the whole sentence)."""
    live = live_worst_first(findings)
    if not live:
        return "no leak found" if not findings else f"{len(findings)} growth{'s' if len(findings) > 1 else ''} cleared"
    shown = live[:_NAMED_MAX]
    more = f"; and {len(live) - len(shown)} more" if len(live) > len(shown) else ""
    return (f"{len(live)} leak finding{'s' if len(live) > 1 else ''}: "
            + "; ".join(mention(f) for f in shown) + more)


_NAMED_MAX = 3  # findings named in the exit summary; the findings file has them all


def _cost_text(overhead: Overhead, recent: tuple[int, float] | None = None) -> str:
    """Absolute seconds first: on a short run the one-off costs (the first census, a finding's culprit
    searches) dominate the share, and a bare "9% of the time" would read as the steady cost. So the
    share of the last steps is said too when the whole run's is at least twice it. A run of no step
    (the job failed before its first) has no share to say: its attach against a few ms of wall time
    read "47.6% of the run"."""
    if overhead.steps == 0:
        return f"agent took {_duration(overhead.seconds_total)}"
    text = f"agent took {_duration(overhead.seconds_total)} ({overhead.ratio:.1%} of the run"
    if overhead.census_seconds_total >= 0.5 * overhead.seconds_total > 0:
        text += f"; tensor censuses {_duration(overhead.census_seconds_total)} of it"
    if recent is not None and overhead.ratio >= 2 * recent[1]:
        text += f"; {recent[1]:.1%} over the last {recent[0]:,} steps"
    return text + ")"


def _duration(seconds: float) -> str:
    if seconds < 1:
        return f"{seconds * 1000:.0f} ms"
    if seconds < 120:
        return f"{seconds:.1f} s"
    if seconds < 2 * 3600:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


def emit(line: str) -> None:
    """To the job's logging when it has any handler for us, else to stderr (never raises)."""
    try:
        if status_log.hasHandlers():
            status_log.info(line)
        else:
            print(line, file=sys.stderr, flush=True)
    except Exception:  # noqa: BLE001 - a closed stderr at exit must not disturb the job
        pass
