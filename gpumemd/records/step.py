"""One training step as the agent recorded it, and the agent's published state."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from gpumemd.records.device import Device, DeviceLike
from gpumemd.records.samples import AllocatorSample, HostSample, NvmlDeviceSample, WorkersSample

if TYPE_CHECKING:
    from gpumemd.records.census import Census
    from gpumemd.records.findings import Finding
    from gpumemd.records.step_profile import StepProfile


@dataclass(frozen=True, slots=True)
class StepRecord:
    """The memory picture at the end of one sampled training step (after ``optimizer.step()``).

    ``steps`` is how many steps this record stands for: 1 when every step is sampled, N when the
    agent samples every Nth step to stay inside its budget (see ``Agent``). ``duration_s`` is the mean
    wall time per step since the previous record (None for the first one).
    ``phase`` is the label set with ``gpumemd.phase(...)`` ("train" by default).
    """

    step: int
    wall_time: float
    duration_s: float | None
    allocator: tuple[AllocatorSample, ...] = ()
    host: HostSample | None = None
    nvml: tuple[NvmlDeviceSample, ...] = ()  # the sampler's last reading, where it pairs (``nvml_paired``)
    phase: str = "train"
    census_total_bytes: int | None = None  # filled on steps where a census ran
    steps: int = 1  # steps since the previous record (this one included)
    workers: WorkersSample | None = None  # the job's child processes' RSS, on every few records

    def allocator_for(self, device: DeviceLike) -> AllocatorSample | None:
        """The allocator sample of ``device``: an ordinal, ``"cuda:0"``, a ``torch.device`` or a ``Device``."""
        device = Device.of(device)
        return next((sample for sample in self.allocator if sample.device == device), None)


NVML_PAIR_MAX_AGE_S = 1.0
"""How much older than a step end's allocator reading an NVML reading may be and still sit beside it
in the record as of the same moment (unless the allocator's reserved bytes have not moved since)."""


def nvml_paired(nvml: Sequence[NvmlDeviceSample], *, at: float, read_with: Sequence[AllocatorSample],
                now: Sequence[AllocatorSample]) -> tuple[NvmlDeviceSample, ...]:
    """The NVML readings a step record taken at wall time ``at`` may carry beside its own allocator
    reading ``now``. The sampler reads NVML every ``sample_interval_s`` (5 s by default), and this
    process's device use minus the reserved bytes of another moment is whatever the allocator did in
    between, not memory outside PyTorch. Kept: readings at most ``NVML_PAIR_MAX_AGE_S`` old, and older
    ones whose device's reserved bytes are still those of ``read_with`` (the allocator reading the
    sampler took with them), which pair exactly as of their own moment. A reading with no time is kept."""
    then = {a.device: a.reserved_bytes for a in read_with}
    current = {a.device: a.reserved_bytes for a in now}
    out = []
    for sample in nvml:
        fresh = sample.read_at is None or at - sample.read_at <= NVML_PAIR_MAX_AGE_S
        reserved = current.get(sample.device)
        if fresh or (reserved is not None and then.get(sample.device) == reserved):
            out.append(sample)
    return tuple(out)


@dataclass(frozen=True, slots=True)
class Identity:
    """Who this process is in its job: used in labels, ports, log lines and file names."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    hostname: str = ""
    pid: int = 0
    source: str = "default"  # "torch.distributed", "torchrun", "slurm", "openmpi" or "default"


@dataclass(frozen=True, slots=True)
class Overhead:
    """What the agent cost the job so far, and its share of wall time since attach.

    Counted: every sampled step end (probes, record, components: censuses and survivor scans
    included), the garbage collector callbacks the agent installed, and the sampler thread, which
    in a CPU job holds the GIL the training thread needs. Not clocked: the counter decrement of an
    unsampled step (clocking it would double it); ``benchmarks/bench_step_overhead.py`` measures
    the whole cost from outside, wall-clock, beside this figure.
    """

    training_thread_seconds_total: float = 0.0  # step ends and gc callbacks, inside the job's thread
    census_seconds_total: float = 0.0  # the part of it spent in tensor censuses
    sampler_seconds_total: float = 0.0  # background thread time (takes the GIL from a CPU job)
    wall_seconds: float = 0.0
    steps: int = 0
    samples: int = 0  # steps sampled (records made); the others only counted

    @property
    def seconds_total(self) -> float:
        """Everything the agent took from the job: training-thread and sampler-thread time."""
        return self.training_thread_seconds_total + self.sampler_seconds_total

    @property
    def ratio(self) -> float:
        """The agent's seconds (training thread and sampler) per wall second since attach (0..1)."""
        return 0.0 if self.wall_seconds <= 0 else min(1.0, self.seconds_total / self.wall_seconds)

    @property
    def seconds_per_step(self) -> float:
        return self.seconds_total / self.steps if self.steps else 0.0


@dataclass(frozen=True, slots=True)
class AgentState:
    """The latest immutable picture, swapped atomically by the agent; outputs only read it.

    A Prometheus scrape or a report writer reads one ``AgentState`` and never takes a lock the
    training thread waits on.
    """

    identity: Identity
    attached_at: float
    updated_at: float
    step: int | None = None
    steps_total: int = 0
    last_step: StepRecord | None = None
    allocator: tuple[AllocatorSample, ...] = ()
    nvml: tuple[NvmlDeviceSample, ...] = ()
    host: HostSample | None = None
    workers: WorkersSample | None = None  # the job's child processes (the sampler's reading: USS and PSS too)
    census: Census | None = None
    censuses_total: int = 0
    findings: tuple[Finding, ...] = ()
    reports: tuple[str, ...] = ()
    ooms_total: int = 0  # every OOM seen: the propagating ones and those the job caught
    ooms_caught: int = 0  # OOMs the observer saw that the job caught and went on from (CUDA)
    oom_caught_steps: tuple[int, ...] = ()  # the steps they happened in (the latest few)
    step_profile: StepProfile | None = None
    phase: str = "train"
    overhead: Overhead = field(default_factory=Overhead)
    probe_errors: Mapping[str, int] = field(default_factory=dict)
    probes_available: Mapping[str, bool] = field(default_factory=dict)
    # How the agent ended, once it has (``ending_words`` lists the values); None while it runs. A
    # reader tells it apart from a vanished one.
    ended: str | None = None
    ended_at: float | None = None

    @property
    def run(self) -> str:
        """This run, as the findings file's lines and the state file name it: one output directory may
        hold several runs' lines) and the ``run_id`` label of ``gpumemd_info`` and the exit marker: the
        pid and the attach time in milliseconds (``4120-1764260000123``). A job started later on the same
        port (Slurm and torchrun reuse 9400 + LOCAL_RANK) has another, so the alerts that join on it
        neither clear nor inherit the page of the job before."""
        return f"{self.identity.pid}-{round(self.attached_at * 1000)}"

def exit_ending(code: int) -> str:
    """``AgentState.ended`` for an exit whose status ``code`` is known (``gpumemd run``): "exit:0", "exit:3"."""
    return f"exit:{code}"


def ending_words(ended: str) -> str:
    """``AgentState.ended`` in words. Its values: "exit:N" (an exit with status N, as ``gpumemd run``
    sees it), "exit" (``detach()``, or an exit whose status python does not tell an ``atexit``
    handler: ``sys.exit(3)`` under ``attach()`` reads so too), the signal that ended the job
    ("SIGTERM", "SIGINT": Ctrl-C or an uncaught KeyboardInterrupt), "oom" (an uncaught out-of-memory
    error) and "exception:T" (another uncaught exception, of type T)."""
    kind, _, detail = ended.partition(":")
    if ended == "exit":
        return "exited (no uncaught exception; its status is known under gpumemd run)"
    if ended == "exit:0":
        return "exited normally (status 0)"
    if kind == "exit":
        return f"exited with status {detail}"
    if ended == "SIGINT":
        return "interrupted (SIGINT: Ctrl-C, or an uncaught KeyboardInterrupt)"
    if ended == "oom":
        return "ended by an uncaught out-of-memory error"
    if kind == "exception":
        return f"ended by an uncaught {detail}"
    return f"ended by {ended}"
