"""What a sampled step end reads: the job's child processes every 100 steps and a second while it has none,
every 10 steps once it has (a /proc read costs ~20 µs after a step of compute)."""

from __future__ import annotations

from gpumemd.records.samples import WorkerSample, WorkersSample
from gpumemd.records.step import AgentState, Identity
from gpumemd.step_reading import WORKERS_EVERY, WORKERS_IDLE_EVERY, WORKERS_IDLE_S, WORKERS_QUICK_EVERY, StepReader


class _Allocator:
    def read(self) -> tuple[()]:
        return ()

    def read_raw(self) -> tuple[()]:
        return ()


class _Host:
    def resident(self) -> tuple[int, int]:
        return 1 << 20, 0


class _Workers:
    def __init__(self) -> None:
        self.pids: tuple[int, ...] = ()

    def rss(self) -> WorkersSample:
        return WorkersSample(tuple(WorkerSample(pid, 1 << 20) for pid in self.pids))


def _reader(workers: _Workers, step_s: float = 0.1) -> StepReader:
    """A reader whose wall clock advances ``step_s`` at each record (one read of it per record)."""
    state = AgentState(identity=Identity(), attached_at=0.0, updated_at=0.0)
    ticks = iter(range(10**6))
    return StepReader(allocator=_Allocator(), host=_Host(), workers=workers,  # type: ignore[arg-type]
                      published=lambda: state, wall_clock=lambda: next(ticks) * step_s, reset_peaks=False)


def test_workers_are_read_every_100_steps_while_the_job_has_none_and_every_10_once_it_has() -> None:
    workers = _Workers()
    reader = _reader(workers)  # 0.1 s steps: 100 steps are more than WORKERS_IDLE_S
    read_at = [n for n in range(250) if reader.record(n, None, 1, "train").workers is not None]
    assert read_at == list(range(0, 250, WORKERS_IDLE_EVERY))
    workers.pids = (4242,)  # a DataLoader started its workers
    read_at = [n for n in range(250, 400) if reader.record(n, None, 1, "train").workers is not None]
    assert read_at == [300, *range(310, 400, WORKERS_EVERY)]  # seen at the next idle read, then every 10
    workers.pids = ()
    read_at = [n for n in range(400, 700) if reader.record(n, None, 1, "train").workers is not None]
    assert read_at == [400, 500, 600]  # gone: back to one read per 100 steps


def test_a_fast_loop_without_workers_looks_for_them_once_a_second() -> None:
    workers = _Workers()
    reader = _reader(workers, step_s=0.001)  # 1,000 steps a second
    read_at = [n for n in range(3_500) if reader.record(n, None, 1, "train").workers is not None]
    assert read_at == list(range(0, 3_500, round(WORKERS_IDLE_S / 0.001)))
    workers.pids = (4242,)  # once seen, every 10 steps, however fast
    read_at = [n for n in range(3_500, 4_200) if reader.record(n, None, 1, "train").workers is not None]
    assert read_at == [4_000, *range(4_010, 4_200, WORKERS_EVERY)]


def test_quick_step_ends_read_the_workers_every_50_steps_and_their_records_carry_them() -> None:
    # A fast loop samples every 10th step, and only one sampled step end in 5 or 10 is full: the
    # workers were read at those alone, and an idle healthy loop's full step ends are 100 steps apart.
    workers = _Workers()
    workers.pids = (4242,)
    reader = _reader(workers, step_s=0.001)
    read_at = [n for n in range(0, 300, 10) if reader.quick(n, None, 10, "train", n // 10).workers is not None]
    assert read_at == list(range(0, 300, WORKERS_QUICK_EVERY))
    record = reader.complete(reader.quick(300, None, 10, "train", 30))
    assert record.workers is not None and [w.pid for w in record.workers.workers] == [4242]
    assert reader.record(310, None, 10, "train").workers is not None  # a full one: every 10 steps, as before


def test_a_record_carries_the_host_rss_read_now_and_the_step_it_was_given() -> None:
    record = _reader(_Workers()).record(7, 0.01, 10, "eval")
    assert (record.step, record.duration_s, record.steps, record.phase) == (7, 0.01, 10, "eval")
    assert record.host is not None and record.host.rss_bytes == 1 << 20 and record.allocator == ()


def test_records_share_the_host_reading_while_the_rss_and_the_sampler_reading_stay() -> None:
    from gpumemd.records.samples import HostSample

    rss = [1 << 20]

    class Host:
        def resident(self) -> tuple[int, int]:
            return rss[0], 0

    state = [AgentState(identity=Identity(), attached_at=0.0, updated_at=0.0,
                        host=HostSample(rss_bytes=1 << 20, available_bytes=8 << 20))]
    reader = StepReader(allocator=_Allocator(), host=Host(), workers=None,  # type: ignore[arg-type]
                        published=lambda: state[0], wall_clock=lambda: 0.0, reset_peaks=False)
    first, second = (reader.record(n, None, 1, "train").host for n in (1, 2))
    assert first is second and first is not None and first.available_bytes == 8 << 20
    rss[0] = 3 << 20  # grew by 2 MiB: a new reading, the headroom down by as much
    third = reader.record(3, None, 1, "train").host
    assert third is not first and third is not None and (third.rss_bytes, third.available_bytes) == (3 << 20, 6 << 20)
    state[0] = AgentState(identity=Identity(), attached_at=0.0, updated_at=1.0,
                          host=HostSample(rss_bytes=3 << 20, available_bytes=5 << 20))  # the sampler read again
    fourth = reader.record(4, None, 1, "train").host
    assert fourth is not third and fourth is not None and fourth.available_bytes == 5 << 20
