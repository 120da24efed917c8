"""``gpumemd report``: one report, every rank's side by side, and one-line errors with exit code 2."""

from __future__ import annotations

import contextlib
import functools
import io
import json
import os
import pickle
import shutil
import tempfile
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from oom_snapshot_data import NEW_MESSAGE, MiB, make_snapshot

from gpumemd.analysis.oom_message import parse_oom_message
from gpumemd.analysis.snapshot_summary import summarize_snapshot
from gpumemd.cli import main
from gpumemd.records.census import Census, CensusGroup, GroupKey
from gpumemd.records.device import Device
from gpumemd.records.findings import Culprit, Finding
from gpumemd.records.oom import ObserverCall
from gpumemd.records.step import Identity
from gpumemd.report.build import ReportInputs, build_report
from gpumemd.report.writer import render_files, report_dir_name, write_report_dir
from tests.json_paths import json_paths

_KEPT = "`kept` in main() at train.py:12 → list of 4 items"
# A leak at the OOM, so that report.json has tensor groups and a breakdown.leak for the edits below.
_CENSUS = Census(step=40, taken_at=0.0, duration_s=0.01, groups=(
    CensusGroup(GroupKey(Device.cuda(0), "float32", (256, 1024), "other", None), 4, 4 * MiB, holder=_KEPT),
    CensusGroup(GroupKey(Device.cuda(0), "float32", (1024, 1024), "parameter", "fc.weight"), 1, 4 * MiB),
))
_LEAK = Finding(kind="tensor_leak", series="tensors{device=cuda:0,group=float32[256, 1024]}", state="suspected",
                slope_bytes_per_step=MiB, slope_low=MiB, slope_high=MiB, onset_step=37, growth_bytes=4 * MiB,
                steps_to_oom=30.0, first_step=40, updated_step=40, summary="tensor leak suspected",
                device=Device.cuda(0),
                culprits=(Culprit("float32[256, 1024]", 4, 4 * MiB, holder=_KEPT),), group="float32[256, 1024]")


def _write(root: str, rank: int, created_at: float, step: int, snapshot: bool = True, *,
           source: str = "excepthook") -> str:
    snap = make_snapshot()
    inputs = ReportInputs(
        created_at=created_at, identity=Identity(rank=rank, world_size=2), source=source,
        exception_type="OutOfMemoryError", exception_message=NEW_MESSAGE, message=parse_oom_message(NEW_MESSAGE),
        step=step, observer=ObserverCall(Device.cuda(0), 8 * MiB, 40 * MiB, 3 * MiB, created_at),
        snapshot_summaries=summarize_snapshot(snap), snapshot_source="oom_observer",
        snapshot_file="snapshot.pickle" if snapshot else None, census=_CENSUS, findings=(_LEAK,),
    )
    files = render_files(build_report(inputs), snap if snapshot else None)
    return write_report_dir(root, report_dir_name(rank, step, created_at), files)


def test_one_report(tmp_path: Any, capsys: Any) -> None:
    path = _write(str(tmp_path), 0, 1763700000.0, 41)
    assert main(["report", path]) == 0
    out = capsys.readouterr().out
    assert "OutOfMemoryError on cuda:0 (rank 0, step 41" in out
    assert " via excepthook · outcome: fatal: nothing caught this OOM and it ended the job" in out.splitlines()[2]
    assert "verdict: fragmentation" in out
    # the leak did not cause a fragmentation OOM, but it is named right after the verdict
    assert out.splitlines()[4].startswith("Also leaking: `kept` grew ~1.00 MiB/step since step 37 and held 4.00 MiB")
    assert "4 × float32[256, 1024]" in out and "← the leak" in out
    assert "snapshot:" in out and "largest free block 4.00 MiB" in out
    assert main(["report", "--json", path]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["snapshot_check"]["devices"][0]["segments"] == 2


@pytest.mark.parametrize(("source", "words"), [
    ("caught", " · outcome: caught: the job caught this OOM and went on"),
    ("oom_guard", " · outcome: raised to the job through gpumemd.oom_guard"),
    ("request", " · outcome: report requested by the job (gpumemd.oom_report)"),
])
def test_one_report_says_whether_the_job_caught_it(tmp_path: Any, capsys: Any, source: str, words: str) -> None:
    path = _write(str(tmp_path), 0, 1763700000.0, 41, source=source)
    assert main(["report", path]) == 0
    written = capsys.readouterr().out.splitlines()[2]
    assert written.startswith("written ") and words in written, written


def test_report_json_itself_reads_its_directory_and_another_file_is_one_line(tmp_path: Any, capsys: Any) -> None:
    path = _write(str(tmp_path), 0, 1763700000.0, 41)
    assert main(["report", os.path.join(path, "report.json")]) == 0
    assert "OutOfMemoryError on cuda:0 (rank 0, step 41" in capsys.readouterr().out
    other = tmp_path / "notes.txt"
    other.write_text("x", encoding="utf-8")
    assert main(["report", str(other)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is a file: pass a report directory" in err


def test_every_rank_side_by_side(tmp_path: Any, capsys: Any) -> None:
    _write(str(tmp_path / "rank1"), 1, 1763700000.0, 41)  # rank 1 failed first
    _write(str(tmp_path / "rank0"), 0, 1763700002.5, 41, snapshot=False, source="caught")
    assert main(["report", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "2 OOM reports from 2 rank(s); rank 1 failed first (step 41" in out
    lines = out.splitlines()
    assert lines[1].split()[:4] == ["rank", "step", "time", "outcome"] and "optimizer state" in lines[1]
    assert [ln.split()[0] for ln in lines[2:]] == ["0", "1"]
    # whether each rank's job caught its OOM or died of it, in a word
    assert [ln.split()[3] for ln in lines[2:]] == ["caught", "fatal"]
    assert main(["report", "--json", str(tmp_path)]) == 0
    view = json.loads(capsys.readouterr().out)
    assert view["first"]["rank"] == 1 and view["ranks"] == [0, 1]
    assert [r["outcome"] for r in view["reports"]] == ["caught", "fatal"]
    assert view["reports"][0]["breakdown"]["reserved_unallocated"] is not None


def test_an_oom_report_of_an_earlier_run_in_the_output_dir_is_named_not_shown_as_this_runs(
        tmp_path: Any, capsys: Any) -> None:
    # Jobs run again in one output dir (the default ./gpumemd-out): last run's OOM report was printed
    # under this run's state files, which had no OOM, as if this run had run out of memory.
    from test_last_state import write_state

    out = tmp_path / "out"
    old = _write(str(out), 0, 1e9 - 3600, 41)
    write_state(out, attached_at=1e9, ended="exit", ended_at=1e9 + 60)
    assert main(["report", str(out)]) == 0
    text = capsys.readouterr().out
    assert "OutOfMemoryError" not in text and "verdict" not in text
    assert text.rstrip().endswith(f"1 OOM report of an earlier run here (before this run attached), not shown: "
                                  f"gpumemd report {old} reads the newest")
    assert main(["report", "--json", str(out)]) == 0
    assert json.loads(capsys.readouterr().out)["earlier_reports"] == [old]
    new = _write(str(out), 0, 1e9 + 30, 900)  # this run's own OOM is shown, the earlier one still named
    assert main(["report", str(out)]) == 0
    text = capsys.readouterr().out
    assert "1 OOM report of an earlier run here" in text and "OutOfMemoryError on cuda:0 (rank 0, step 900" in text
    assert main(["report", "--json", str(out)]) == 0  # named in JSON too, beside this run's report
    assert json.loads(capsys.readouterr().out)["earlier_reports"] == [old]
    assert new != old


@pytest.mark.parametrize("case", ["missing", "empty", "truncated", "foreign", "future", "evil_snapshot",
                                  "truncated_snapshot"])
def test_bad_input_is_one_line_and_exit_2(tmp_path: Any, capsys: Any, case: str) -> None:
    target = str(tmp_path / "r")
    if case == "missing":
        target = str(tmp_path / "absent")
    elif case == "empty":
        os.makedirs(target)
    else:
        target = _write(str(tmp_path), 0, 1763700000.0, 1)
        report_json = os.path.join(target, "report.json")
        with open(report_json, encoding="utf-8") as f:
            text = f.read()
        replacement = {
            "truncated": text[: len(text) // 2],
            "foreign": json.dumps({"hello": "world"}),
            "future": text.replace('"schema_version": 1', '"schema_version": 99'),
        }.get(case)
        if replacement is not None:
            with open(report_json, "w", encoding="utf-8") as f:
                f.write(replacement)
        if case == "evil_snapshot":
            class Evil:
                def __reduce__(self) -> tuple[Any, ...]:
                    return (os.remove, (report_json,))

            with open(os.path.join(target, "snapshot.pickle"), "wb") as f:
                pickle.dump({"segments": [], "x": Evil()}, f)
        elif case == "truncated_snapshot":
            with open(os.path.join(target, "snapshot.pickle"), "rb+") as f:
                f.truncate(100)
    assert main(["report", target]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert err.startswith("gpumemd report: ")
    if case == "evil_snapshot":
        assert "refused to load posix.remove" in err or "refused to load os.remove" in err
        assert os.path.exists(os.path.join(target, "report.json"))  # the pickle did not run


# --- report.json is outside input: any edit is read or refused in one line ----------

_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70) | st.floats(allow_nan=True)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6,
)


@functools.cache
def _valid_report() -> dict[str, Any]:
    root = tempfile.mkdtemp(prefix="gpumemd-report-")
    with open(os.path.join(_write(root, 0, 1763700000.0, 41, snapshot=False), "report.json"), encoding="utf-8") as f:
        return json.load(f)  # type: ignore[no-any-return]


# CI runs a fixed set (derandomized); REPORT_FUZZ_EXAMPLES=5000 explores with fresh random examples.
@settings(max_examples=int(os.environ.get("REPORT_FUZZ_EXAMPLES", "150")), deadline=None,
          derandomize=not os.environ.get("REPORT_FUZZ_EXAMPLES"))
@given(data=st.data())
def test_any_edit_of_report_json_is_read_or_refused_in_one_line(data: st.DataObject) -> None:
    report = json.loads(json.dumps(_valid_report()))
    path = data.draw(st.sampled_from([p for p in json_paths(report) if p]))
    node = report
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = data.draw(_JSON)
    directory = tempfile.mkdtemp(prefix="gpumemd-report-")
    try:
        with open(os.path.join(directory, "report.json"), "w", encoding="utf-8") as f:
            json.dump(report, f)
        for argv in (["report", directory], ["report", "--json", directory]):
            out, err = io.StringIO(), io.StringIO()
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                code = main(argv)
            assert code in (0, 2), (path, code)
            if code == 2:
                assert err.getvalue().count("\n") == 1, err.getvalue()
    finally:
        shutil.rmtree(directory, ignore_errors=True)


@pytest.mark.parametrize(("edit", "fragment"), [
    ({"schema_version": True}, "schema_version True"),
    ({"schema_version": 0}, "schema_version 0"),
    ({"peak_bytes": "lots"}, "peak_bytes: expected an integer, got 'lots'"),
])
def test_bad_fields_are_named(tmp_path: Any, capsys: Any, edit: dict[str, Any], fragment: str) -> None:
    report = {**_valid_report(), **edit}
    (tmp_path / "report.json").write_text(json.dumps(report), encoding="utf-8")
    assert main(["report", str(tmp_path)]) == 2
    assert fragment in capsys.readouterr().err


def test_deep_nesting_is_refused(tmp_path: Any, capsys: Any) -> None:
    (tmp_path / "report.json").write_text("[" * 100_000 + "]" * 100_000, encoding="utf-8")
    assert main(["report", str(tmp_path)]) == 2
    assert "nested too deeply" in capsys.readouterr().err
