"""What the human reports show, on hand-built records: one row per tensor group with its holder, the
leak on the first screen, one set of words everywhere, no empty timeline columns, a table of
contents whose links land, and charts with ticks, units and the leak onset and OOM marked."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from gpumemd.cli import main
from gpumemd.records.census import Census, CensusGroup, GroupKey, TensorEntry
from gpumemd.records.device import CPU
from gpumemd.records.findings import Culprit, Finding
from gpumemd.records.oom import BREAKDOWN_LABELS, HOST_LABELS, OomMessage
from gpumemd.records.samples import HostSample
from gpumemd.records.step import Identity, StepRecord
from gpumemd.report.build import ReportInputs, build_report
from gpumemd.report.markdown import render_markdown
from gpumemd.report.svg import byte_ticks, step_ticks, timeline_chart
from gpumemd.report.view import group_rows, sections, slug, timeline_columns
from gpumemd.report.writer import render_files, write_report_dir

MiB, GiB = 2**20, 2**30
HOLDER = "`kept` in main() at train.py:12 → list of 770 items"


def _leak_inputs(**over: Any) -> ReportInputs:
    leaking = CensusGroup(GroupKey(CPU, "float32", (512, 1024), "other", None), 770, 770 * 2 * MiB, holder=HOLDER)
    param = CensusGroup(GroupKey(CPU, "float32", (64, 64), "parameter", "fc.weight"), 1, 16384)
    # The ranked tensor list is 770 identical storages: the old reports printed them row after row.
    largest = tuple(TensorEntry(2 * MiB, (512, 1024), "float32", "cpu", "other") for _ in range(50))
    census = Census(step=799, taken_at=0.0, duration_s=0.1, groups=(leaking, param), largest=largest)
    finding = Finding(
        kind="tensor_leak", series="tensors{device=cpu,group=float32[512, 1024]}", state="confirmed",
        slope_bytes_per_step=2 * MiB, slope_low=2 * MiB, slope_high=2 * MiB, onset_step=31, growth_bytes=GiB,
        steps_to_oom=9000.0, first_step=520, updated_step=700,
        summary="tensor leak confirmed on tensors{device=cpu,group=float32[512, 1024]}, +1 tensor/step",
        culprits=(Culprit("float32[512, 1024]", 500, GiB, holder=HOLDER),), device=CPU, group="float32[512, 1024]")
    steps = [StepRecord(step=i, wall_time=1000.0 + i, duration_s=0.01, phase="train",
                        host=HostSample(rss_bytes=300 * MiB + max(0, i - 31) * 2 * MiB))
             for i in range(0, 800, 10)]
    base: dict[str, Any] = dict(
        created_at=1763700000.5, identity=Identity(rank=0, world_size=1), source="excepthook",
        exception_type="RuntimeError", exception_message="DefaultCPUAllocator: can't allocate memory",
        message=OomMessage(kind="cpu", format="cpu", requested_bytes=512 * MiB), step=800, census=census,
        findings=(finding,), steps=steps,
        host=HostSample(rss_bytes=1800 * MiB, available_bytes=21 * GiB, total_bytes=round(23.5 * GiB)),
    )
    base.update(over)
    return ReportInputs(**base)


@pytest.fixture(scope="module")
def files() -> dict[str, str]:
    report = json.loads(json.dumps(build_report(_leak_inputs()), allow_nan=False))
    return {name: data.decode() for name, data in render_files(report, None).items()}


def test_the_first_screen_of_the_markdown_names_the_leak_and_its_holder(files: dict[str, str]) -> None:
    first = "\n".join(files["report.md"].splitlines()[:40])
    assert "**leak** — `kept` grew ~2.00 MiB/step since step 31 and held 1.50 GiB of the host's 23.50 GiB" in first
    assert f"| 1.50 GiB | 770 × float32[512, 1024] | other | {HOLDER} ← the leak |" in first
    assert "1. **Stop `kept` from growing (confirmed tensor leak)** — saves about 1.50 GiB." in first


def test_each_group_is_one_row(files: dict[str, str]) -> None:
    md = files["report.md"]
    assert md.count("float32[512, 1024] |") == 1 and "| 2.00 MiB |" not in md
    assert files["report.html"].count("770 × float32[512, 1024]</td>") == 1


def test_an_old_report_without_groups_is_grouped_from_its_tensor_list() -> None:
    top = [{"nbytes": 2 * MiB, "shape": [512, 1024], "dtype": "float32", "device": "cpu", "category": "other",
            "name": None, "holder": None, "graph_bytes": 0}] * 25
    [row] = group_rows({"available": True, "top": top})
    assert row.count == 25 and row.total == 50 * MiB and row.tensors == "25 × float32[512, 1024]"
    # and a key listed twice is still one row
    groups = [{**top[0], "count": 3, "nbytes": 6 * MiB}, {**top[0], "count": 2, "nbytes": 4 * MiB, "holder": "x"}]
    [row] = group_rows({"available": True, "groups": groups})
    assert row.count == 5 and row.who == "x"


def test_one_set_of_words_for_the_breakdown_in_the_cli_markdown_and_html(
        files: dict[str, str], tmp_path: Any, capsys: Any) -> None:
    path = write_report_dir(str(tmp_path), "oom-x", {k: v.encode() for k, v in files.items()})
    assert main(["report", path]) == 0
    cli = capsys.readouterr().out
    for key in ("leaked", "parameters", "optimizer_state", "process_other", "non_pytorch", "free"):
        words = HOST_LABELS.get(key) or BREAKDOWN_LABELS[key]
        assert words in cli and words in files["report.md"] and words in files["report.html"], key
    assert "process_other" not in cli and "non_pytorch" not in cli
    lines = cli.splitlines()
    assert lines[3].startswith("verdict: leak: `kept` grew ~2.00 MiB/step since step 31")
    assert lines[4].startswith("largest tensor groups (")
    assert lines[5].split() == ["1.50", "GiB", "770", "×", "float32[512,", "1024]", "other", *HOLDER.split(), "←",
                                "the", "leak"]


def test_timeline_columns_that_are_all_absent_are_left_out(files: dict[str, str]) -> None:
    md = files["report.md"]
    header = next(line for line in md.splitlines() if line.startswith("| step | phase"))
    assert header == "| step | phase | process RSS |"  # no allocator columns on CPU
    rows = [{"step": 1, "allocated_bytes": 5, "reserved_bytes": None, "rss_bytes": None}]
    assert [k for k, _ in timeline_columns(rows)] == ["allocated_bytes"]
    assert not re.search(r"\| - \| - \|", md)


def test_the_table_of_contents_links_land_on_headings(files: dict[str, str]) -> None:
    md, html = files["report.md"], files["report.html"]
    report = json.loads(files["report.json"])
    titles = sections(report)
    assert titles[:3] == ["Verdict", "Largest tensor groups", "Suggestions"]
    for title in titles:
        assert f"[{title}](#{slug(title)})" in md and f"\n## {title}\n" in md
        assert f'href="#{slug(title)}"' in html and f'id="{slug(title)}"' in html


def test_html_first_screen_before_any_chart_tells_the_story(files: dict[str, str]) -> None:
    html = files["report.html"]
    first = html[:html.index("<svg")]
    assert "<code>kept</code> grew ~2.00 MiB/step since step 31" in first
    assert 'class="leak"' in first and "← the leak" in first
    assert first.index(">Largest tensor groups<") < first.index(">Suggestions<")


def test_ticks_are_round_numbers_with_units() -> None:
    assert byte_ticks(1.8 * GiB) == ([0, 0.5, 1.0, 1.5, 2.0], "GiB", float(GiB))
    assert byte_ticks(700 * MiB)[1] == "MiB" and byte_ticks(700 * MiB)[0][-1] >= 700
    assert step_ticks(0, 800) == [0, 100, 200, 300, 400, 500, 600, 700, 800]
    assert step_ticks(5, 5) == [5]


def test_the_timeline_chart_marks_the_leak_onset_and_the_oom(files: dict[str, str]) -> None:
    svg = files["report.html"].split('aria-label="memory per step"', 1)[1].split("</svg>", 1)[0]
    assert ">leak onset: kept (step 31)</text>" in svg and ">OOM (step 800)</text>" in svg
    assert ">1.5 GiB</text>" in svg and ">step</text>" in svg and ">400</text>" in svg
    assert ">process RSS</text>" in svg and "allocated" not in svg  # the host's series only


def test_a_chart_without_data_is_empty() -> None:
    assert timeline_chart([{"step": 1, "rss_bytes": None}], [("rss_bytes", "process RSS")]) == ""


def test_without_a_leak_the_verdict_is_unchanged_and_no_row_is_marked() -> None:
    report = build_report(_leak_inputs(findings=()))
    assert report["breakdown"]["verdict"] == "unknown" and report["breakdown"]["leak"] is None
    md = render_markdown(report)
    assert "← the leak" not in md and "leak onset" not in md
