"""``gpumemd demo``: a small real training loop with the agent attached, printed as it goes."""

from __future__ import annotations

import argparse
import sys
import tempfile
from typing import TYPE_CHECKING, Any, TextIO

import gpumemd
from gpumemd.analysis.units import format_bytes
from gpumemd.cli.errors import CliError

if TYPE_CHECKING:
    from gpumemd.records.step import AgentState, Overhead


def add_parser(sub: Any) -> None:
    p = sub.add_parser("demo", help="run a small real training loop with the agent attached")
    p.add_argument("--steps", type=int, default=300, help="training steps to run (default 300)")
    p.add_argument("--leak-from", type=int, default=60,
                   help="step from which the loop keeps each batch's predictions, computed without "
                        "torch.no_grad(), so each step's forward graph stays alive (default 60; -1: healthy)")
    p.add_argument("--output-dir", default=None, help="where findings go (default: a temporary directory)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace, out: TextIO | None = None) -> int:
    out = out or sys.stdout
    if args.steps < 1:
        raise CliError(f"--steps={args.steps} is not valid: expected an integer >= 1")
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device not in ("cpu", "cuda") or (device == "cuda" and not torch.cuda.is_available()):
        raise CliError(f"--device={device!r} is not valid here: expected cpu" +
                       (" or cuda" if torch.cuda.is_available() else " (no CUDA device on this machine)"))
    output_dir = args.output_dir or tempfile.mkdtemp(prefix="gpumemd-demo-")
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512), torch.nn.ReLU(),
        torch.nn.Linear(512, 10),
    ).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    history: list[torch.Tensor] = []  # the planted leak: predictions kept with their autograd graphs
    print(f"gpumemd demo: {args.steps} steps on {device}; output in {output_dir}", file=out)
    print("demo settings, so that a short run shows detection: a 60-step leak window checked every 10 steps "
          "(defaults: 500 steps, every 50)", file=out)
    columns = _Columns(cuda=device == "cuda")
    print(columns.header(), file=out)
    with gpumemd.attached(model=model, optimizer=optimizer, output_dir=output_dir, sample_interval_s=0.5,
                          leak_warmup_steps=20, leak_window_steps=60,
                          leak_check_every_steps=10) as agent:
        for step in range(args.steps):
            x = torch.randn(256, 256, device=device)
            y = torch.randint(0, 10, (256,), device=device)
            logits = model(x)
            loss = torch.nn.functional.cross_entropy(logits, y)
            if 0 <= args.leak_from <= step:
                # "keep predictions for the epoch metric", computed without torch.no_grad(): each one
                # keeps its whole forward graph (saved activations included) alive.
                history.append(model(x))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if step % 20 == 0 or step == args.steps - 1:
                print(columns.row(agent.state(), agent.overhead()), file=out)
        findings = agent.findings()
        overhead = agent.overhead()
    print("", file=out)
    print(f"agent time: {overhead.seconds_total * 1e3:.0f} ms over {overhead.steps} steps "
          f"({overhead.ratio:.1%} of wall time): {columns.first_census_ms:.0f} ms the one-off first tensor census, "
          f"then {columns.steady_share:.1%} of the time since (this demo checks for leaks every 10 steps and "
          f"attributes what it finds; a long job is held to its {agent.config.overhead_budget:.0%} budget)", file=out)
    for finding in findings:
        print(f"[{finding.state}] {finding.summary}", file=out)
    if not findings:
        print("no leak findings", file=out)
    return 0


class _Columns:
    """The demo's table. The "agent" column is the agent's share of the time since the previous
    row, so the one-off first census shows once instead of weighing on every later row; "tensors"
    is the latest census, labelled with the step it was taken at (censuses are spaced out)."""

    def __init__(self, *, cuda: bool) -> None:
        self.cuda = cuda  # no "allocated" column on a CPU run: it would be "-" in every row
        self._last: tuple[float, float] | None = None  # (agent seconds, wall seconds) at the last row
        self._first_census_s: float | None = None
        self._steady: tuple[float, float] = (0.0, 0.0)  # agent and wall seconds after the first census

    def header(self) -> str:
        alloc = f" {'allocated':>11}" if self.cuda else ""
        return f"{'step':>5} {'host RSS':>11}{alloc} {'tensors (at step)':>19} {'agent':>7}  finding"

    def row(self, state: AgentState, overhead: Overhead) -> str:
        """``overhead`` is read live (``agent.overhead()``): the state's copy may predate the census
        its own step end ran."""
        rec = state.last_step
        agent_s, wall_s = overhead.seconds_total, overhead.wall_seconds
        prev_agent, prev_wall = self._last or (0.0, 0.0)
        share = (agent_s - prev_agent) / (wall_s - prev_wall) if wall_s > prev_wall else 0.0
        if self._first_census_s is None and state.census is not None:
            self._first_census_s = state.census.duration_s
        elif self._last is not None:
            self._steady = (self._steady[0] + agent_s - prev_agent, self._steady[1] + wall_s - prev_wall)
        self._last = (agent_s, wall_s)
        census = (f"{format_bytes(state.census.total_bytes)} @{state.census.step}"
                  if state.census is not None else "-")
        alloc = ""
        if self.cuda:
            alloc = f" {format_bytes(rec.allocator[0].allocated_bytes if rec and rec.allocator else None):>11}"
        latest = next((f for f in reversed(state.findings)), None)
        note = f"{latest.kind} {latest.state}" if latest else ""
        rss = format_bytes(rec.host.rss_bytes if rec and rec.host else None)
        return f"{state.step:>5} {rss:>11}{alloc} {census:>19} {share:>7.1%}  {note}"

    @property
    def first_census_ms(self) -> float:
        return (self._first_census_s or 0.0) * 1e3

    @property
    def steady_share(self) -> float:
        agent_s, wall_s = self._steady
        return agent_s / wall_s if wall_s > 0 else 0.0
