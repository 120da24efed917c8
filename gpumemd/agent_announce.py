"""What the agent says when it attaches and when it stops (the lines themselves are
``gpumemd.announce``'s): the facts it gathers for them, and who says them.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING

from gpumemd.announce import StartFacts, emit, exit_summary
from gpumemd.probes.process.identity import rank_prefix

if TYPE_CHECKING:
    from gpumemd.output_dir import SettledOutput
    from gpumemd.records.step import AgentState
    from gpumemd.state_board import Probe

log = logging.getLogger("gpumemd")


def start_facts(state: AgentState, probes: Mapping[str, Probe], *, nvml_on: bool, output_dir: str,
                metrics_url: str | None, sampler_absent: str | None = None) -> StartFacts:
    """The start line's facts: where output goes, the devices watched, and the probes, readings and
    threads that cannot work here (an agent that attached degraded says so where it is seen)."""
    identity = state.identity
    absent = {name: reason for name, probe in probes.items() if (reason := probe.health.absent_reason)}
    for probe in probes.values():
        absent.update(probe.health.partial)
    if sampler_absent is not None:
        absent["sampler thread"] = f"{sampler_absent}; readings are taken at sampled steps only"
    if not nvml_on:
        absent["nvml"] = "off by configuration"
    devices: tuple[str, ...] = ()
    if "allocator" not in absent:
        devices = tuple(s.device.name for s in state.allocator) or ("the CUDA devices the job uses",)
    return StartFacts(pid=os.getpid(), rank=identity.rank, world_size=identity.world_size,
                      output_dir=output_dir, metrics_url=metrics_url, devices=devices, absent=absent)


def say(line: str, *, rank: int, quiet: bool) -> None:
    """Rank 0 speaks for the job; a 1,024-rank job must not print 1,024 start lines."""
    if quiet or rank != 0:
        log.debug("%s", line)
        return
    emit(line)


def say_exit(line: str, state: AgentState, *, quiet: bool) -> None:
    """The exit summary speaks for its own rank, and says which in a multi-process job. A rank other
    than 0 says it too when it has news (a live finding, an OOM report): rank 0's "no leak found" was
    the last word on a torchrun job whose rank 1 leaked. A job of many healthy ranks still prints one."""
    identity = state.identity
    news = bool(state.reports) or any(f.state != "cleared" for f in state.findings)
    if quiet or (identity.rank != 0 and not news):
        log.debug("%s", line)
        return
    emit(rank_prefix(identity) + line.removeprefix("gpumemd"))


def warn_output(settled: SettledOutput, *, rank: int, quiet: bool) -> None:
    """An output directory that cannot be written is a warning on every rank: rank 0's start line says
    it, the others (and a quiet rank 0) log it."""
    if settled.problem is not None and (quiet or rank != 0):
        log.warning("gpumemd: output %s", settled.words())


def exit_line(state: AgentState, output_dir: str, *, recent: tuple[int, float] | None = None) -> str | None:
    """The exit summary, or None when it cannot be made: stopping must finish whatever it meets."""
    try:
        return exit_summary(state, output_dir, recent=recent)
    except Exception:  # stopping must finish whatever the summary meets
        log.debug("gpumemd: no exit summary", exc_info=True)
        return None
