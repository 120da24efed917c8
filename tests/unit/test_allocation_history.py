"""One owner for torch's process-wide allocation history, on a fake torch
with the real call shapes: a recording the job switched on is used and never switched off; gpumemd
switches on once for all its users and off after the last."""

from __future__ import annotations

from typing import Any

from gpumemd.probes.device.allocation_history import AllocationHistory
from gpumemd.probes.snapshots.snapshot import SnapshotProbe


class FakeTorch:
    def __init__(self, *, recording: bool = False, legacy: bool = False, fails: bool = False) -> None:
        self.recording = recording
        self.calls: list[Any] = []
        outer = self

        def record(enabled: Any = "all", context: Any = "all", stacks: str = "all", max_entries: int = 1) -> None:
            if fails:
                raise RuntimeError("cudaMallocAsync does not yet support _record_memory_history")
            outer.calls.append((enabled, max_entries))
            outer.recording = enabled is not None

        def legacy_record(enabled: Any = True, trace_alloc_max_entries: int = 1,
                          trace_alloc_record_context: bool = False) -> None:
            outer.calls.append((enabled, trace_alloc_max_entries))
            outer.recording = bool(enabled)

        memory = type("memory", (), {"_record_memory_history": staticmethod(legacy_record if legacy else record)})
        self.cuda = type("cuda", (), {"memory": memory, "is_initialized": staticmethod(lambda: True)})
        self._C = type("C", (), {"_cuda_isHistoryEnabled": staticmethod(lambda: outer.recording)})


def test_the_jobs_own_recording_is_used_and_never_switched_off() -> None:
    torch = FakeTorch(recording=True)
    history = AllocationHistory(torch)
    assert history.acquire("leak", 100) and history.acquire("oom", 100)
    history.release("leak")
    history.release("oom")
    assert torch.calls == [] and torch.recording  # settings untouched, still recording


def test_switched_on_once_for_every_user_and_off_after_the_last() -> None:
    torch = FakeTorch()
    history = AllocationHistory(torch)
    assert history.acquire("oom", 5000) and history.acquire("leak", 100)
    assert torch.calls == [("all", 5000)] and history.switched_on_by_us
    history.release("oom")
    assert torch.recording  # the leak detector still uses it
    history.release("leak")
    assert torch.calls[-1][0] is None and not torch.recording and not history.switched_on_by_us
    history.release("leak")  # idempotent
    assert len(torch.calls) == 2


def test_legacy_api_and_a_backend_that_cannot_record() -> None:
    old = FakeTorch(legacy=True)
    history = AllocationHistory(old)
    assert history.acquire("oom", 99) and old.calls == [(True, 99)]
    history.release("oom")
    assert not old.calls[-1][0] and not old.recording
    broken = AllocationHistory(FakeTorch(fails=True))
    assert broken.acquire("oom", 10) is False and broken.users == frozenset()


def test_snapshot_probe_and_leak_share_one_switch() -> None:
    torch = FakeTorch()
    history = AllocationHistory(torch)
    probe = SnapshotProbe(torch_module=torch, history=history)
    assert probe.enable_history(1000) and history.acquire("leak", 10)
    probe.disable_history()
    assert torch.recording  # the probe leaving does not switch off the leak detector's recording
    history.release("leak")
    assert not torch.recording
