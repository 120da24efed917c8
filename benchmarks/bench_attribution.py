"""Attribution over a long leaking job: the agent's training-thread time against its overhead budget,
and the longest pauses it puts on the training thread (at state changes above all).

    python benchmarks/bench_attribution.py                 # 30 minutes of ~10 ms steps
    python benchmarks/bench_attribution.py --minutes 1     # a quick look (~1 minute)

The job: one real CPU training loop, an MLP (width -> width -> 128) with AdamW on a fixed random batch,
one intra-op thread. Its step time is set by *calibrating the width* before attach, as
``bench_step_overhead.py`` does (the lower quartile of ~0.2 s of steps; step time grows about as width
squared): every step is real compute, nothing is padded with a busy wait. The job then runs under
``gpumemd.attach(output_dir=<tmp>)`` at its DEFAULT settings for ``--minutes``. From step ``--onset`` on
it keeps four rows of each step's outputs (``out[:4].detach().clone()``: 4 x 128 float32 = 2 KiB per
step, the scenario suite's "list of outputs") in ``kept_outputs``, a list held by a local of the loop.

Measured: each whole step's wall time (forward, backward, the optimizer step with the agent's step end,
the append) and the agent's own clocked training-thread time in it (``agent.overhead()``, read outside
the step's timing), and whether the agent sampled that step end. The longest pause on the training
thread is read as the longest steps minus the median step; each of the five longest is shown with its
step number, what the agent clocked in it (a long step the agent did not clock is the machine: another
process, the allocator), what the agent did in it (a census, a leak evaluation, a survivor scan, a heap
look: the counters that grew in that step), and whether a finding changed state there (every state
change in the findings file, ``first_step`` / ``updated_step``). The agent's step numbers are this loop's (0-based):
nothing steps an optimizer before attach. Notes: the first sampled step takes the first census (a
one-time start-up cost); gc-callback time is clocked at the next sampled step end, not where the
collection ran. ``--gc-objects N`` keeps N more gc-tracked objects alive (empty lists) for the whole
run, for the pauses at a large heap.

It is a measurement: it prints its tables and exits 0 whatever the figures are.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import statistics
import tempfile
import time
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

import gpumemd
from gpumemd.components.leak import LeakComponent
from gpumemd.records.findings import Finding
from gpumemd.records.step import Overhead

OUT_FEATURES = 128  # the model's outputs: 4 rows of them are the 2 KiB kept per step
KEPT_ROWS = 4


def make_job(hidden: int, batch: int) -> Callable[[], torch.Tensor]:
    """The MLP's training step; it returns the step's outputs (the loop keeps rows of them)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(hidden, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, hidden), torch.nn.ReLU(),
        torch.nn.Linear(hidden, OUT_FEATURES),
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(batch, hidden)
    y = torch.randint(0, OUT_FEATURES, (batch,))

    def step() -> torch.Tensor:
        out = model(x)
        loss = torch.nn.functional.cross_entropy(out, y)
        loss.backward()
        opt.step()  # the agent's optimizer hook ends the step here
        opt.zero_grad(set_to_none=True)
        return out

    return step


def _quartile_step(step: Callable[[], torch.Tensor], n: int) -> float:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return statistics.quantiles(times, n=4)[0]


def calibrate(target_s: float, batch: int) -> int:
    """The width whose step takes about ``target_s`` here (the lower quartile, which a busy neighbour
    moves less than the median). Runs before attach, so the agent never sees these optimizers' steps."""
    hidden = 256
    for _ in range(5):
        step = make_job(hidden, batch)
        _quartile_step(step, 10)
        took = _quartile_step(step, max(20, int(0.2 / target_s)))
        hidden = max(8, round(hidden * (target_s / took) ** 0.5))
    return hidden


@dataclass
class Steps:
    """Per step of the attached run: wall seconds, the agent's clocked seconds in it, sampled or not,
    and what the agent did in it (``WORK`` bits)."""

    wall: array[float] = field(default_factory=lambda: array("d"))
    clocked: array[float] = field(default_factory=lambda: array("d"))
    sampled: bytearray = field(default_factory=bytearray)
    work: bytearray = field(default_factory=bytearray)


WORK = ("census", "evaluation", "survivor scan", "heap look")
"""What a step's bits say the agent did in it: the census seconds (a census or a slice of one), the
leak component's evaluate / scan / host-look seconds grew."""


def _work_marks(overhead: Overhead, leak: LeakComponent | None) -> tuple[float, ...]:
    """The counters whose growth in a step says what the agent did (cheap: no state is built)."""
    censuses = overhead.census_seconds_total
    if leak is None:
        return (censuses, 0.0, 0.0, 0.0)
    return (censuses, leak.evaluate_seconds, leak.scan_seconds, leak.host_look_seconds)


@dataclass
class Run:
    """What the attached run left: its steps, the agent's and the leak component's figures, the findings."""

    steps: Steps
    hidden: int
    batch: int
    wall_s: float = 0.0
    thread_s: float = 0.0
    census_s: float = 0.0
    sampler_s: float = 0.0
    samples: int = 0
    evaluate_s: float = 0.0
    scan_s: float = 0.0
    host_look_s: float = 0.0
    budget: float = 0.0
    findings: list[Finding] = field(default_factory=list)
    changes: list[dict[str, object]] = field(default_factory=list)  # every state change in the findings file
    output_dir: str = ""
    interrupted: bool = False


def _train(agent: gpumemd.Agent, step: Callable[[], torch.Tensor], seconds: float, onset: int, steps: Steps
           ) -> bool:
    """The leaking loop; False when it ran its time, True when interrupted (Ctrl-C: report what ran)."""
    kept_outputs: list[torch.Tensor] = []  # the leak: a list held by a local
    pc = time.perf_counter
    overhead = agent.overhead
    leak = agent.component(LeakComponent)
    deadline = pc() + seconds
    number = 0
    try:
        while pc() < deadline:
            before = overhead()
            marks = _work_marks(before, leak)
            t0 = pc()
            out = step()
            if number >= onset:
                kept_outputs.append(out[:KEPT_ROWS].detach().clone())
            t1 = pc()
            after = overhead()
            steps.wall.append(t1 - t0)
            steps.clocked.append(after.training_thread_seconds_total - before.training_thread_seconds_total)
            steps.sampled.append(after.samples > before.samples)
            grew = zip(marks, _work_marks(after, leak), strict=True)
            steps.work.append(sum(1 << bit for bit, (a, b) in enumerate(grew) if b > a))
            number += 1
    except KeyboardInterrupt:
        return True
    finally:
        kept_outputs.clear()
    return False


def _state_changes(path: str) -> list[dict[str, object]]:
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def run(args: argparse.Namespace) -> Run:
    torch.set_num_threads(1)
    hidden = calibrate(args.step_ms / 1e3, args.batch)
    step = make_job(hidden, args.batch)
    output_dir = args.output_dir or tempfile.mkdtemp(prefix="gpumemd-bench-attribution-")
    result = Run(Steps(), hidden, args.batch, output_dir=output_dir)
    start = time.perf_counter()
    with gpumemd.attached(output_dir=output_dir) as agent:
        result.interrupted = _train(agent, step, args.minutes * 60.0, args.onset, result.steps)
        overhead = agent.overhead()
        leak = agent.component(LeakComponent)
        path = ""
        if leak is not None:
            result.evaluate_s, result.scan_s = leak.evaluate_seconds, leak.scan_seconds
            result.host_look_s = leak.host_look_seconds
            path = leak.findings_path
        result.findings = agent.findings()
        result.budget = agent.config.overhead_budget
    result.wall_s = time.perf_counter() - start
    result.thread_s, result.census_s = overhead.training_thread_seconds_total, overhead.census_seconds_total
    result.sampler_s, result.samples = overhead.sampler_seconds_total, overhead.samples
    result.changes = _state_changes(path) if path else []
    return result


def _pct(seconds: float, wall: float) -> str:
    return f"{seconds:.3f} s ({seconds / wall:.3%} of wall)" if wall > 0 else f"{seconds:.3f} s"


def _change_steps(r: Run) -> dict[int, str]:
    """Step -> what changed there ("suspected tensor_leak", ...), from the findings file and the findings."""
    out: dict[int, str] = {}
    for c in r.changes:
        at = c.get("updated_step")
        if isinstance(at, int):
            out[at] = f"{c.get('state')} {c.get('kind')}"
    for f in r.findings:
        out.setdefault(f.first_step, f"raised ({f.kind})")
        out.setdefault(f.updated_step, f"{f.state} {f.kind}")
    return out


def summary_table(r: Run, args: argparse.Namespace) -> None:
    s = r.steps
    n = len(s.wall)
    median = statistics.median(s.wall) if n else 0.0
    longest_clocked = max(range(n), key=s.clocked.__getitem__) if n else None
    print(f"## Attribution cost over a leaking job (torch {torch.__version__}, 1 intra-op thread, attach() defaults)\n")
    print("| measure | value |\n|---|---|")
    print(f"| wall time (attach to detach) | {r.wall_s:.1f} s{' (interrupted)' if r.interrupted else ''} |")
    print(f"| steps | {n:,} (leak of {KEPT_ROWS * OUT_FEATURES * 4:,} B/step from step {args.onset}; MLP width "
          f"{r.hidden}, batch {r.batch}, AdamW) |")
    print(f"| median step | {median * 1e3:.2f} ms (asked {args.step_ms:g} ms) |")
    print(f"| steps sampled by the agent | {r.samples:,} (1 in {n / max(r.samples, 1):.1f}) |")
    print(f"| agent's training-thread seconds | {_pct(r.thread_s, r.wall_s)} |")
    print(f"| of which tensor censuses | {_pct(r.census_s, r.wall_s)} |")
    print(f"| agent's sampler-thread seconds | {_pct(r.sampler_s, r.wall_s)} |")
    print(f"| leak component: evaluations | {_pct(r.evaluate_s, r.wall_s)} |")
    print(f"| of which heap looks (host_look_seconds) | {_pct(r.host_look_s, r.wall_s)} |")
    print(f"| leak component: survivor scans | {_pct(r.scan_s, r.wall_s)} |")
    print(f"| overhead budget (config.overhead_budget) | {r.budget:.1%} of wall |")
    if n and longest_clocked is not None:
        print(f"| longest step minus median | {(max(s.wall) - median) * 1e3:.1f} ms |")
        print(f"| longest agent-clocked step | {s.clocked[longest_clocked] * 1e3:.1f} ms at step {longest_clocked} "
              f"(step took {s.wall[longest_clocked] * 1e3:.1f} ms) |")
    print(f"| gc-tracked objects at start | {args.gc_count:,} ({args.gc_objects:,} added) |")
    print(f"| output directory | {r.output_dir} |\n")


def _work(bits: int) -> str:
    return ", ".join(name for bit, name in enumerate(WORK) if bits >> bit & 1) or "-"


def longest_table(r: Run, changes: dict[int, str], top: int = 5) -> None:
    s = r.steps
    if not s.wall:
        return
    median = statistics.median(s.wall)
    order: Sequence[int] = sorted(range(len(s.wall)), key=s.wall.__getitem__, reverse=True)[:top]
    print(f"### The {top} longest steps\n")
    print("| step | step ms | minus median ms | agent clocked ms | sampled | agent's work | state change |\n"
          "|---|---|---|---|---|---|---|")
    for i in order:
        print(f"| {i} | {s.wall[i] * 1e3:.1f} | {(s.wall[i] - median) * 1e3:+.1f} | {s.clocked[i] * 1e3:.1f} | "
              f"{'yes' if s.sampled[i] else 'no'} | {_work(s.work[i])} | {changes.get(i, '-')} |")
    print()


def changes_table(r: Run, changes: dict[int, str]) -> None:
    s = r.steps
    if not changes:
        return
    median = statistics.median(s.wall) if s.wall else 0.0
    print("### The state-change steps\n")
    print("| step | change | step ms | minus median ms | agent clocked ms | agent's work |\n|---|---|---|---|---|---|")
    for at in sorted(changes):
        timed = 0 <= at < len(s.wall)
        cells = (f"{s.wall[at] * 1e3:.1f} | {(s.wall[at] - median) * 1e3:+.1f} | {s.clocked[at] * 1e3:.1f} | "
                 f"{_work(s.work[at])}" if timed else "- | - | - | -")
        print(f"| {at} | {changes[at]} | {cells} |")
    print()


def findings_table(r: Run, onset: int) -> None:
    print("### Findings at the end\n")
    if not r.findings:
        print("(none)\n")
        return
    print("| state | kind | onset (error) | first step | updated step | headline |\n|---|---|---|---|---|---|")
    for f in r.findings:
        err = f"{f.onset_step} ({f.onset_step - onset:+d})" if f.onset_step is not None else "-"
        headline = (f.headline or f.summary).replace("|", "\\|")
        print(f"| {f.state} | {f.kind} | {err} | {f.first_step} | {f.updated_step} | {headline} |")
    print()


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--minutes", type=float, default=30.0, help="how long the attached job runs (default 30)")
    ap.add_argument("--step-ms", type=float, default=10.0, help="the step time to calibrate to (default 10)")
    ap.add_argument("--onset", type=int, default=300, help="the first leaking step (default 300)")
    ap.add_argument("--batch", type=int, default=1024,
                    help="the MLP's batch (default 1024: a narrow MLP whose working set stays in cache)")
    ap.add_argument("--gc-objects", type=int, default=0,
                    help="keep this many more gc-tracked objects alive during the run (default 0)")
    ap.add_argument("--output-dir", default=None, help="the agent's output directory (default: a new temp dir)")
    args = ap.parse_args()
    logging.getLogger("gpumemd").setLevel(logging.WARNING)  # the state-change lines, as a user sees them
    ballast: list[list[int]] = [[] for _ in range(args.gc_objects)]
    args.gc_count = len(gc.get_objects())
    result = run(args)
    del ballast
    changes = _change_steps(result)
    summary_table(result, args)
    longest_table(result, changes)
    changes_table(result, changes)
    findings_table(result, args.onset)


if __name__ == "__main__":
    main()
