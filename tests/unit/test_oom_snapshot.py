"""Snapshots: our summary of PyTorch's format, PyTorch's own _memory_viz on the same data, and the
restricted unpickler that must never run code from a snapshot someone sent."""

from __future__ import annotations

import os
import pickle
from collections import OrderedDict
from typing import Any

import pytest
import torch.cuda._memory_viz as memory_viz
from cuda_recordings import recorded_snapshots
from oom_snapshot_data import SEG_A, MiB, make_snapshot

from gpumemd.analysis.alloc_sites import live_by_site
from gpumemd.analysis.snapshot_summary import expandable_segments_enabled, summarize_snapshot
from gpumemd.probes.holding.package_dirs import internal_dirs, library_dirs
from gpumemd.probes.snapshots.snapshot import SnapshotProbe
from gpumemd.probes.snapshots.snapshot_load import load_snapshot, loads_snapshot
from gpumemd.probes.snapshots.snapshot_rules import SnapshotLoadError
from gpumemd.records.device import Device


def test_summary_reads_segments_blocks_and_the_oom_entry() -> None:
    s = summarize_snapshot(make_snapshot())[Device.cuda(0)]
    assert s.segments == 2
    assert s.reserved_bytes == 22 * MiB
    assert s.allocated_bytes == 14 * MiB + 512
    assert s.inactive_bytes == 8 * MiB - 512
    assert s.largest_free_block_bytes == 4 * MiB
    assert s.trace_entries == 6
    assert (s.oom_requested_bytes, s.oom_device_free_bytes) == (8 * MiB, 3 * MiB)
    assert s.sites[0].frame == "/job/model.py:40:forward"
    assert s.sites[0].nbytes == 14 * MiB + 512 and s.sites[0].blocks == 3
    assert expandable_segments_enabled(make_snapshot()) is False


def test_summary_of_a_bare_segment_list_like_memory_snapshot() -> None:
    s = summarize_snapshot(make_snapshot()["segments"])[Device.cuda(0)]
    assert s.reserved_bytes == 22 * MiB and s.trace_entries == 0 and s.oom_requested_bytes is None


def test_pytorch_memory_viz_accepts_the_hand_made_snapshot() -> None:
    data = pickle.loads(pickle.dumps(make_snapshot(history=30)))  # as read back from snapshot.pickle
    stats = memory_viz.segsum(data)  # "stats": asserts sum(block sizes) == total_size per segment
    assert "segments: 2" in stats and "total_reserved: 22.0MiB" in stats
    trace_text = memory_viz.trace(data)
    assert "raise OutOfMemoryError # 8.0MiB requested, 3.0MiB free in CUDA" in trace_text
    html = memory_viz.trace_plot(data)
    assert html.lstrip().startswith("<!DOCTYPE html>") and "local_files" in html


class _Boom:
    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, ("touch /tmp/gpumemd-pwned",))


def test_restricted_unpickler_refuses_code(tmp_path: Any) -> None:
    marker = tmp_path / "pwned"

    class _Touch:
        def __reduce__(self) -> tuple[Any, ...]:
            return (open, (str(marker), "w"))

    for evil in ({"segments": [], "x": _Touch()}, _Boom()):
        data = pickle.dumps(evil)
        with pytest.raises(SnapshotLoadError, match="refused to load"):
            loads_snapshot(data)
    assert not marker.exists()
    assert pickle.loads(pickle.dumps({"segments": [], "x": 1})) == {"segments": [], "x": 1}


def test_restricted_unpickler_reads_real_and_harmless_data(tmp_path: Any) -> None:
    snap = make_snapshot(history=6)
    path = tmp_path / "snapshot.pickle"
    path.write_bytes(pickle.dumps(snap))
    assert load_snapshot(str(path)) == snap
    assert loads_snapshot(pickle.dumps(snap["segments"])) == snap["segments"]
    ordered = loads_snapshot(pickle.dumps(OrderedDict(segments=[], tags={1, 2})))
    assert isinstance(ordered, dict) and ordered["tags"] == {1, 2}


def test_truncated_foreign_and_missing_snapshots_are_clear_errors(tmp_path: Any) -> None:
    data = pickle.dumps(make_snapshot())
    with pytest.raises(SnapshotLoadError, match="truncated"):
        loads_snapshot(data[: len(data) // 2])
    with pytest.raises(SnapshotLoadError, match="not a PyTorch memory snapshot"):
        loads_snapshot(pickle.dumps(42))
    with pytest.raises(SnapshotLoadError, match="cannot read"):
        load_snapshot(str(tmp_path / "absent.pickle"))


def test_probe_on_a_cpu_build_is_absent_not_raising() -> None:
    probe = SnapshotProbe()
    assert probe.cuda_initialized() is False
    assert probe.capture() is None
    assert probe.memory_summary(0) is None
    assert probe.enable_history(10) is False
    assert probe.attach_oom_observer(lambda *a: None) is False
    probe.disable_history()


class _FakeMemory:
    def __init__(self, legacy: bool) -> None:
        self.calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = []
        self.legacy = legacy

    def _snapshot(self) -> dict[str, Any]:
        return make_snapshot()

    def _record_memory_history(self, *args: Any, **kwargs: Any) -> None:
        self.calls.append((args, kwargs))


class _FakeTorch:
    """torch's CUDA surface as the probe uses it (a CUDA build, initialised by the job)."""

    def __init__(self, legacy: bool = False) -> None:
        memory = _FakeMemory(legacy)
        if legacy:
            def _record(enabled: Any = True, trace_alloc_max_entries: int = 1,
                        trace_alloc_record_context: bool = False) -> None:
                memory.calls.append(((enabled,), {"trace_alloc_max_entries": trace_alloc_max_entries,
                                                  "trace_alloc_record_context": trace_alloc_record_context}))
        else:
            def _record(enabled: Any = "all", context: Any = "all", stacks: str = "all",  # type: ignore[misc]
                        max_entries: int = 2**63 - 1) -> None:
                memory.calls.append(((), {"enabled": enabled, "context": context, "stacks": stacks,
                                          "max_entries": max_entries}))
        memory._record_memory_history = _record  # type: ignore[method-assign]
        self.memory = memory
        self.cuda = type("cuda", (), {"is_initialized": staticmethod(lambda: True), "memory": memory,
                                      "memory_summary": staticmethod(lambda d: f"summary of {d}")})
        self._C = type("C", (), {})


def test_history_is_bounded_and_feature_detected() -> None:
    new = _FakeTorch()
    probe = SnapshotProbe(torch_module=new)
    assert probe.enable_history(1234) is True
    assert new.memory.calls[-1][1] == {"enabled": "all", "context": "all", "stacks": "python", "max_entries": 1234}
    probe.disable_history()
    assert new.memory.calls[-1][1]["enabled"] is None
    old = _FakeTorch(legacy=True)
    assert SnapshotProbe(torch_module=old).enable_history(99) is True
    assert old.memory.calls[-1][1]["trace_alloc_max_entries"] == 99
    assert SnapshotProbe(torch_module=new).capture()["segments"][0]["address"] == SEG_A  # type: ignore[index]


def test_summary_names_the_first_user_frame_and_survives_wrong_types() -> None:
    """The OOM report's sites, and a snapshot with wrong field types (a pickle that
    loads fine can still say ``"device": "x"``): the summary never raises on it."""
    import os

    import torch

    inside = {"filename": os.path.join(os.path.dirname(torch.__file__), "nn", "functional.py"), "line": 9, "name": "f"}
    user = {"filename": "/job/train.py", "line": 57, "name": "main"}
    snap = {"segments": [{"device": 0, "total_size": 4096, "blocks": [
        {"size": 4096, "state": "active_allocated", "frames": [inside, user]}]}]}
    internal = (os.path.dirname(torch.__file__) + "/",)
    (site,) = summarize_snapshot(snap, internal=internal)[Device.cuda(0)].sites
    assert site.frame == "/job/train.py:57:main"
    odd = {"segments": [{"device": "x", "total_size": None, "blocks": [{"size": "big", "state": "active_allocated",
                                                                       "frames": "not a list"}, 7]}, 3],
           "device_traces": [[{"action": "oom", "size": "?"}]]}
    assert summarize_snapshot(odd)[Device.cuda(0)].segments == 1


@pytest.mark.parametrize("path", recorded_snapshots(), ids=lambda p: p.stem)
def test_real_cuda_snapshots_load_summarize_and_open_in_memory_viz(path: Any) -> None:
    """A snapshot recorded on a real device (benchmarks/gpu_record.py): the restricted unpickler reads it,
    the summary finds its segments and the recorder's allocating line, and torch's viewer opens the same data."""
    snapshot = load_snapshot(str(path))
    summary = summarize_snapshot(snapshot)[Device.cuda(0)]
    assert summary.segments > 0 and summary.reserved_bytes >= summary.allocated_bytes > 0
    # Sites are found live, on the machine that recorded: its torch directory is internal, as
    # package_dirs.internal_dirs() says there (read here from the snapshot's own frames).
    files = {f["filename"] for seg in snapshot["segments"] for b in seg["blocks"] for f in b.get("frames", ())}
    theirs = {f[: -len("nn/modules/module.py")] for f in files if f.endswith("/torch/nn/modules/module.py")}
    assert theirs, "the recording's blocks carry Python frames"
    sites = live_by_site(snapshot, 0, internal=(*theirs, *internal_dirs()), library=library_dirs())
    assert any(site.startswith("gpu_record.py:") for site in sites), sorted(sites)[:5]
    assert "segments:" in memory_viz.segsum(snapshot)
    assert memory_viz.trace_plot(snapshot).lstrip().startswith("<!DOCTYPE html>")
