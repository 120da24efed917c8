"""``gpumemd demo``: a small real training loop with the agent attached, printed as it goes."""

from __future__ import annotations

import argparse
import sys
import tempfile
from typing import Any, TextIO

from gpumemd.analysis.units import format_bytes


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
    from gpumemd.cli import CliError

    out = out or sys.stdout
    if args.steps < 1:
        raise CliError(f"--steps={args.steps} is not valid: expected an integer >= 1")
    import torch

    import gpumemd

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
    header = f"{'step':>5} {'host RSS':>11} {'allocated':>11} {'tensors':>11} {'overhead':>9}  finding"
    print(header, file=out)
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
                _print_row(agent, out)
        findings = agent.findings()
        overhead = agent.state().overhead
    print("", file=out)
    print(f"agent time on the training thread: {overhead.training_thread_seconds_total * 1e3:.0f} ms over "
          f"{overhead.steps} steps ({overhead.ratio:.1%} of wall time; {overhead.census_seconds_total * 1e3:.0f} ms "
          "of it in tensor censuses, which a long job spaces to its overhead budget)", file=out)
    if findings:
        for finding in findings:
            print(f"[{finding.state}] {finding.summary}", file=out)
    else:
        print("no leak findings", file=out)
    return 0


def _print_row(agent: Any, out: TextIO) -> None:
    state = agent.state()
    rec = state.last_step
    alloc = rec.allocator[0].allocated_bytes if rec and rec.allocator else None
    census = state.census.total_bytes if state.census is not None else None
    latest = next((f for f in reversed(state.findings)), None)
    note = f"{latest.kind} {latest.state}" if latest else ""
    print(
        f"{state.step:>5} {format_bytes(rec.host.rss_bytes if rec and rec.host else None):>11} "
        f"{format_bytes(alloc):>11} {format_bytes(census):>11} {state.overhead.ratio * 100:>8.2f}%  {note}",
        file=out,
    )
