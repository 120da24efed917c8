"""The report files: strict JSON, self-contained HTML, Markdown, a snapshot memory_viz reads, and an
atomic directory write that leaves nothing behind when the disk fails halfway."""

from __future__ import annotations

import json
import os
import pickle
from html.parser import HTMLParser
from typing import Any

import pytest
import torch.cuda._memory_viz as memory_viz
from oom_snapshot_data import NEW_MESSAGE, MiB, make_snapshot

from gpumemd.analysis.oom_message import parse_oom_message
from gpumemd.analysis.snapshot_summary import summarize_snapshot
from gpumemd.records.census import Census, CensusGroup, GroupKey, TensorEntry
from gpumemd.records.device import Device
from gpumemd.records.oom import ObserverCall
from gpumemd.records.samples import AllocatorSample
from gpumemd.records.step import Identity, StepRecord
from gpumemd.records.step_profile import StepProfile
from gpumemd.report import writer
from gpumemd.report.build import SCHEMA_VERSION, ReportInputs, build_report
from gpumemd.report.html import render_html
from gpumemd.report.load import load_report
from gpumemd.report.markdown import render_markdown
from gpumemd.report.writer import render_files, report_dir_name, write_report_dir


def _inputs(**over: Any) -> ReportInputs:
    steps = [StepRecord(step=i, wall_time=1000.0 + i, duration_s=0.1, phase="train",
                        allocator=(AllocatorSample(device=Device.cuda(0), allocated_bytes=(4 + i) * MiB,
                                                   allocated_peak_bytes=(9 + i) * MiB, reserved_bytes=22 * MiB),))
             for i in range(30)]
    entry = TensorEntry(nbytes=6 * MiB, shape=(1536, 1024), dtype="float32", device=Device.cuda(0),
                        category="parameter", name="<script>alert(1)</script>.weight")
    census = Census(step=29, taken_at=1029.0, duration_s=0.01, largest=(entry,),
                    groups=(CensusGroup(GroupKey(Device.cuda(0), "float32", (1536, 1024), "parameter", entry.name), 1,
                                        6 * MiB),))
    base: dict[str, Any] = dict(
        created_at=1763700000.5, identity=Identity(rank=3, world_size=8, hostname="node7", pid=11),
        source="oom_guard", exception_type="OutOfMemoryError", exception_message=NEW_MESSAGE,
        traceback_text="Traceback (most recent call last):\n  File \"train.py\", line 88\n",
        message=parse_oom_message(NEW_MESSAGE), step=30,
        observer=ObserverCall(Device.cuda(0), 8 * MiB, 40 * MiB, 3 * MiB, 1763700000.4),
        snapshot_summaries=summarize_snapshot(make_snapshot()), snapshot_source="oom_observer",
        snapshot_file="snapshot.pickle", census=census, steps=steps,
        environment={"torch": "2.13.0", "rank": 3}, memory_summary="|  PyTorch CUDA memory summary  |",
    )
    base.update(over)
    return ReportInputs(**base)


def test_report_json_is_strict_and_versioned() -> None:
    report = build_report(_inputs())
    text = json.dumps(report, allow_nan=False)
    back = json.loads(text)
    assert back["schema_version"] == SCHEMA_VERSION and back["kind"] == "gpumemd.oom_report"
    assert back["rank"] == 3 and back["step"] == 30
    assert back["breakdown"]["device"] == "cuda:0"
    assert back["breakdown"]["verdict"] == "fragmentation"
    assert back["breakdown"]["total_bytes"] == 40 * MiB  # the observer's total/cap wins over the message
    assert back["peak_bytes"] == 38 * MiB
    assert len(back["timeline"]) == 30 and back["timeline"][-1]["allocated_bytes"] == 33 * MiB
    assert back["tensors"]["top"][0]["shape"] == [1536, 1024]
    assert back["snapshot"]["devices"][0]["largest_free_block_bytes"] == 4 * MiB
    assert any(s["kind"] == "expandable_segments" for s in back["suggestions"])


class _Loads(HTMLParser):
    """Collects everything in a page that would make a browser fetch something."""

    LOADING_TAGS = frozenset({"script", "link", "img", "iframe", "object", "embed", "source", "audio", "video",
                              "image", "use", "frame", "track", "input", "base"})

    def __init__(self) -> None:
        super().__init__()
        self.problems: list[str] = []
        self.in_style = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag in self.LOADING_TAGS:
            self.problems.append(f"<{tag}>")
        for name, value in attrs:
            if tag == "a" and name == "href" and (value or "").startswith("#"):
                continue  # an in-page anchor (the table of contents) loads nothing
            if name in ("src", "href", "xlink:href", "srcset", "action", "data", "poster", "background"):
                self.problems.append(f"{tag}[{name}={value}]")
            if name == "style" and value and ("url(" in value or "@import" in value):
                self.problems.append(f"{tag}[style]")
        self.in_style = tag == "style"

    def handle_endtag(self, tag: str) -> None:
        self.in_style = False if tag == "style" else self.in_style

    def handle_data(self, data: str) -> None:
        if self.in_style and ("url(" in data or "@import" in data):
            self.problems.append("style url()/@import")


def test_html_is_self_contained_and_escapes_user_data() -> None:
    files = render_files(build_report(_inputs()), make_snapshot())
    html = files["report.html"].decode()
    parser = _Loads()
    parser.feed(html)
    assert parser.problems == []
    assert "<script>alert(1)</script>" not in html and "&lt;script&gt;" in html
    assert html.count("<svg") >= 2  # the breakdown bar and the timeline
    assert "<polyline" in html
    md = files["report.md"].decode()
    for section in ("## Verdict", "## Breakdown", "## Suggestions", "## Largest tensor groups", "## Timeline"):
        assert section in md


def test_step_profile_is_in_every_rendering_when_measured() -> None:
    profile = StepProfile(step=25, device=Device.cuda(0), forward_start_bytes=10 * MiB, forward_peak_bytes=36 * MiB,
                          after_backward_bytes=14 * MiB, after_step_bytes=None, saved_for_backward_bytes=24 * MiB,
                          saved_tensors=17, parameter_bytes=6 * MiB)
    report = json.loads(json.dumps(build_report(_inputs(step_profile=profile)), allow_nan=False))

    section = report["step_profile"]
    assert section["step"] == 25 and section["device"] == "cuda:0" and section["saved_tensors"] == 17
    figures = {f["name"]: f["nbytes"] for f in section["figures"]}
    # What was not measured (after_step, gradients...) is left out, never written as 0.
    assert figures == {"forward_start": 10 * MiB, "forward_peak": 36 * MiB, "after_backward": 14 * MiB,
                       "saved_for_backward": 24 * MiB, "parameters": 6 * MiB, "forward_transient": 26 * MiB}
    files = render_files(report, make_snapshot())
    md = files["report.md"].decode()
    assert "## Step profile" in md and "step 25" in md
    assert "| forward peak | 36.00 MiB |" in md and "| saved for backward (activations) | 24.00 MiB |" in md
    assert "after optimizer step" not in md
    html = files["report.html"].decode()
    assert ">Step profile</h2>" in html and "forward peak" in html and "36.00 MiB" in html


def test_without_a_step_profile_the_report_has_no_step_profile_section() -> None:
    report = build_report(_inputs())
    assert report["step_profile"] is None
    files = render_files(report, make_snapshot())
    assert "Step profile" not in files["report.md"].decode() and "Step profile" not in files["report.html"].decode()


def test_a_report_written_before_the_step_profile_was_renamed_still_loads_and_renders(tmp_path: Any) -> None:
    """The previous release wrote the step profile under the key "phases"."""
    profile = StepProfile(step=25, device=Device.cuda(0), forward_start_bytes=10 * MiB, forward_peak_bytes=36 * MiB,
                          after_backward_bytes=14 * MiB, after_step_bytes=None, saved_for_backward_bytes=24 * MiB,
                          saved_tensors=17, parameter_bytes=6 * MiB)
    report = json.loads(json.dumps(build_report(_inputs(step_profile=profile)), allow_nan=False))
    old = {("phases" if key == "step_profile" else key): value for key, value in report.items()}
    path = write_report_dir(str(tmp_path), "old", {"report.json": json.dumps(old).encode()})

    loaded = load_report(path)

    assert loaded["step_profile"] == report["step_profile"] and "phases" not in loaded
    md = render_markdown(loaded)
    assert "## Step profile" in md and "| forward peak | 36.00 MiB |" in md
    assert ">Step profile</h2>" in render_html(loaded)


def test_snapshot_file_is_exactly_what_torch_writes_and_memory_viz_reads(tmp_path: Any) -> None:
    snap = make_snapshot(history=9)
    files = render_files(build_report(_inputs()), snap)
    assert files["snapshot.pickle"] == pickle.dumps(snap)
    path = write_report_dir(str(tmp_path), "r", files)
    with open(os.path.join(path, "snapshot.pickle"), "rb") as f:
        data = pickle.load(f)
    assert "total_reserved: 22.0MiB" in memory_viz.segsum(data)
    assert "OutOfMemoryError" in memory_viz.trace(data)


def test_directory_name_carries_rank_step_and_time() -> None:
    name = report_dir_name(3, 30, 1763700000.5)
    assert name == "oom-rank3-step000030-20251121T044000.500Z"
    assert report_dir_name(0, None, 0.0).startswith("oom-rank0-stepnone-")


def test_write_is_atomic_and_never_overwrites(tmp_path: Any) -> None:
    files = {"report.json": b"{}", "report.md": b"#"}
    first = write_report_dir(str(tmp_path), "oom-x", files)
    second = write_report_dir(str(tmp_path), "oom-x", files)
    assert first.endswith("oom-x") and second.endswith("oom-x-2")
    assert sorted(os.listdir(tmp_path)) == ["oom-x", "oom-x-2"]


def test_a_disk_failure_halfway_leaves_no_partial_directory(tmp_path: Any, monkeypatch: Any) -> None:
    real = writer._write_file
    written: list[str] = []

    def failing(path: str, data: bytes) -> None:
        if written:
            raise OSError(28, "No space left on device")
        written.append(path)
        real(path, data)

    monkeypatch.setattr(writer, "_write_file", failing)
    with pytest.raises(OSError, match="No space left"):
        write_report_dir(str(tmp_path), "oom-y", render_files(build_report(_inputs()), make_snapshot()))
    assert len(written) == 1  # it did fail halfway, after one file was on disk
    assert os.listdir(tmp_path) == []
