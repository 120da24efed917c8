"""``gpumemd report`` on hostile files: seeded mutations of report.json and snapshot.pickle (bytes and
structure), a few seconds in all. Every outcome is a report (exit 0) or one refusal line naming the
file (exit 2), and nothing printed carries a terminal control character."""

from __future__ import annotations

import contextlib
import io
import json
import os
import pickle
import random
import re
import shutil
import tempfile
import time
from typing import Any

from oom_snapshot_data import make_snapshot
from test_cli_report import _valid_report

from gpumemd.cli import main
from tests.json_paths import json_paths

_SECONDS = 1.0  # per file kind: a bounded budget of mutations, the same sequence every run (seeded)
_CONTROL = re.compile(r"[\x00-\x09\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")
_NASTY: list[Any] = [
    None, True, -1, 0, 2**63, 2**70, -(2**70), 1e300, -1e300, 1.5, "", "\x1b[2J\x1b[Hsnapshot OK", "\u202eevil",
    "a\nsnapshot: OK", [], {}, [1], {"x": 1}, [[]], "x" * 300,
]


def _mutate(rng: random.Random, doc: Any) -> Any:
    doc = json.loads(json.dumps(doc))
    for _ in range(rng.randint(1, 3)):
        paths = [p for p in json_paths(doc) if p]
        if not paths:
            break
        path = rng.choice(paths)
        node = doc
        for key in path[:-1]:
            node = node[key]
        if rng.random() < 0.3:  # a field or an entry gone
            del node[path[-1]]
        else:
            node[path[-1]] = rng.choice(_NASTY)
    return doc


def _run(directory: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["report", directory])
    return code, out.getvalue(), err.getvalue()


def _check(directory: str, name: str, what: str) -> None:
    code, out, err = _run(directory)
    assert code in (0, 2), (what, code, err)
    assert not _CONTROL.search(out + err), (what, out + err)
    if code == 2:
        assert err.count("\n") == 1 and err.endswith("\n"), (what, err)
        assert os.path.join(directory, name) in err or directory in err, (what, err)


def test_mutated_report_json_is_read_or_refused_in_one_escaped_line() -> None:
    rng = random.Random(28)
    base = _valid_report()
    directory = tempfile.mkdtemp(prefix="gpumemd-fuzz-")
    try:
        deadline = time.monotonic() + _SECONDS
        runs = 0
        while time.monotonic() < deadline or runs < 50:
            doc = _mutate(rng, base)
            text = json.dumps(doc)
            if rng.random() < 0.1:  # numbers JSON allows and Python may not (digits, exponents)
                text = text.replace('"peak_bytes": ', '"peak_bytes": ' + rng.choice(["9" * 5000, "1e999", "-0"]) + ", "
                                    '"x": ', 1)
            with open(os.path.join(directory, "report.json"), "w", encoding="utf-8") as f:
                f.write(text)
            _check(directory, "report.json", text[:300])
            runs += 1
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def _snapshot_bytes(rng: random.Random, base: dict[str, Any], raw: bytes) -> bytes:
    if rng.random() < 0.5:
        data = bytearray(raw)
        for _ in range(rng.randint(1, 4)):
            at = rng.randrange(len(data) + 1)
            payload = bytes(rng.randrange(256) for _ in range(rng.randint(1, 8)))
            kind = rng.randrange(3)
            if kind == 0:
                data[at:at + len(payload)] = payload
            elif kind == 1:
                data[at:at] = payload
            else:
                del data[at:at + len(payload)]
        return bytes(data)
    return pickle.dumps(_mutate(rng, base), protocol=rng.choice([2, 3, 4, 5]))


def test_mutated_snapshots_are_read_or_refused_in_one_escaped_line() -> None:
    rng = random.Random(2828)
    report = _valid_report()
    base = make_snapshot(history=3)
    raw = pickle.dumps(base)
    directory = tempfile.mkdtemp(prefix="gpumemd-fuzz-")
    try:
        with open(os.path.join(directory, "report.json"), "w", encoding="utf-8") as f:
            json.dump(report, f)
        deadline = time.monotonic() + _SECONDS
        runs = 0
        while time.monotonic() < deadline or runs < 50:
            data = _snapshot_bytes(rng, base, raw)
            with open(os.path.join(directory, "snapshot.pickle"), "wb") as f:
                f.write(data)
            _check(directory, "snapshot.pickle", repr(data[:200]))
            runs += 1
    finally:
        shutil.rmtree(directory, ignore_errors=True)


# --- the reproducers, one each ----------------------------------------------------------------------


def _report_dir(report: dict[str, Any], snapshot: bytes | None = None) -> str:
    directory = tempfile.mkdtemp(prefix="gpumemd-hostile-")
    with open(os.path.join(directory, "report.json"), "w", encoding="utf-8") as f:
        json.dump(report, f)
    if snapshot is not None:
        with open(os.path.join(directory, "snapshot.pickle"), "wb") as f:
            f.write(snapshot)
    return directory


def _refusal(report: dict[str, Any], snapshot: bytes | None = None, *, name: str = "report.json") -> str:
    directory = _report_dir(report, snapshot)
    try:
        code, out, err = _run(directory)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    assert code == 2 and not out, (out, err)
    assert err.count("\n") == 1 and os.path.join(directory, name) in err, err
    assert not _CONTROL.search(err), err
    return err


def test_bad_fields_of_report_json_are_named_not_tracebacks() -> None:
    report = _valid_report()
    assert "created_at: expected seconds since 1970" in _refusal({**report, "created_at": 1e300})
    text = json.dumps(report).replace('"peak_bytes": ', '"peak_bytes": ' + "9" * 5000 + ', "_": ', 1)
    directory = tempfile.mkdtemp(prefix="gpumemd-hostile-")
    try:
        with open(os.path.join(directory, "report.json"), "w", encoding="utf-8") as f:
            f.write(text)
        code, _, err = _run(directory)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    assert code == 2 and "report.json is malformed: peak_bytes: expected an integer, got a 5000-digit integer" in err
    # a suggestion without its saving is still a suggestion
    suggestions = [{"title": "use bf16", "why": "halves activations"}]
    directory = _report_dir({**report, "suggestions": suggestions})
    try:
        code, out, _ = _run(directory)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    assert code == 0 and "1. use bf16 (saves ~-): halves activations" in out


def test_snapshots_of_the_wrong_shape_are_named_not_tracebacks() -> None:
    snapshot = make_snapshot(history=3)
    err = _refusal(_valid_report(), pickle.dumps({**snapshot, "device_traces": 5}), name="snapshot.pickle")
    assert "device_traces: expected a list (one per device), got int" in err


def test_terminal_escapes_from_the_files_are_printed_escaped() -> None:
    fake = "\x1b[2J\x1b[Hsnapshot: OK\nverdict: fine"
    report = {**_valid_report(), "source": fake}
    directory = _report_dir(report)
    try:
        code, out, _ = _run(directory)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    assert code == 0 and "via \\x1b[2J\\x1b[Hsnapshot: OK\\nverdict: fine" in out
    assert not _CONTROL.search(out) and "\nverdict: fine" not in out
    # a refusal quoting the file's bytes (a global's name) quotes them escaped
    evil = b"\x80\x02c\x1b[2Jos\nsystem\n)R."
    err = _refusal(_valid_report(), evil, name="snapshot.pickle")
    assert "refused to load \\x1b[2Jos.system" in err


def test_a_snapshot_that_expands_far_past_its_size_is_refused_before_it_is_built() -> None:
    from gpumemd.probes.snapshots.snapshot_load import loads_snapshot
    from gpumemd.probes.snapshots.snapshot_rules import Limits, SnapshotLoadError

    limits = Limits(min_built_bytes=2**20)  # the per-byte bound binds at this small size too
    empty_sets = pickle.dumps({"segments": [set() for _ in range(20_000)]})  # 40 KB building ~4.5 MB of sets
    try:
        loads_snapshot(empty_sets, limits)
    except SnapshotLoadError as exc:
        assert "its objects would take more than the 1 MiB a" in str(exc)
    else:
        raise AssertionError("a file of empty sets was built")
    real = pickle.dumps(make_snapshot(history=2_000))  # 8.5x its size: loads under the same limits
    assert loads_snapshot(real, limits)["segments"]


# --- the state file a job leaves beside its reports ----------------------------------------------------

_STATE_NAME = "gpumemd-state-rank3.json"


def _valid_state() -> dict[str, Any]:
    return {"schema": 1, "pid": 2**22 + 17, "rank": 3, "world_size": 4, "hostname": "node7", "attached_at": 1e9,
            "written_at": 1e9 + 600, "step": 4100, "steps_total": 4101, "phase": "train", "seconds_per_step": 0.2,
            "headroom": [{"where": "cuda:0", "free_bytes": 2**30, "total_bytes": 80 * 2**30},
                         {"where": "host", "free_bytes": 2**29, "total_bytes": 64 * 2**30, "rss_bytes": 60 * 2**30}],
            "findings": [{"state": "confirmed", "kind": "tensor_leak", "series": "allocated_bytes{device=0}",
                          "device": 0, "slope_bytes_per_step": 4e6, "growth_bytes": 2**34, "steps_to_oom": 120.0,
                          "hours_to_oom": 0.01, "updated_step": 4000, "headline": "tensor leak confirmed: `kept`",
                          "summary": "..."}] * 2,
            "findings_more": 3, "ooms_total": 1, "reports": ["/out/oom-1"], "ended": None, "ended_at": None}


def _run_state(directory: str, rng: random.Random) -> tuple[str, tuple[int, str, str]]:
    doc = _mutate(rng, _valid_state())
    if isinstance(doc, dict) and rng.random() < 0.5:  # the schema kept, so the mutation reaches the fields
        doc["schema"] = 1
    text = json.dumps(doc)
    if rng.random() < 0.05:
        text = text.replace('"step": ', '"step": ' + rng.choice(["9" * 5000, "1e999", "[" * 5000]) + ', "x": ', 1)
    with open(os.path.join(directory, _STATE_NAME), "w", encoding="utf-8") as f:
        f.write(text)
    args = ["report", "--json", directory] if rng.random() < 0.5 else ["report", directory]
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(args)
    return text[:300], (code, out.getvalue(), err.getvalue())


def test_mutated_state_files_are_read_or_refused_in_one_escaped_line() -> None:
    rng = random.Random(38)
    directory = tempfile.mkdtemp(prefix="gpumemd-fuzz-")
    codes: dict[int, int] = {}
    try:
        for _ in range(600):
            what, (code, out, err) = _run_state(directory, rng)
            assert code in (0, 2), (what, code, err)
            assert not _CONTROL.search(out + err), (what, out + err)
            if code == 2:
                assert err.count("\n") == 1 and os.path.join(directory, _STATE_NAME) in err, (what, err)
            codes[code] = codes.get(code, 0) + 1
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    assert codes.get(0, 0) > 50 and codes.get(2, 0) > 50, codes  # both outcomes were reached


def test_escapes_in_the_state_file_are_printed_escaped() -> None:
    directory = tempfile.mkdtemp(prefix="gpumemd-hostile-")
    evil = "vm\u001b]0;pwned\u0007\u001b[2J"
    state = _valid_state()
    state["findings"] = [{**state["findings"][0], "headline": "\u202eevil\nfinding: fake"}]
    try:
        with open(os.path.join(directory, _STATE_NAME), "w", encoding="utf-8") as f:
            json.dump({**state, "hostname": evil, "phase": evil, "ended": evil, "ended_at": 1e9}, f)
        code, out, _ = _run(directory)
        assert code == 0 and "on vm\\x1b]0;pwned\\x07\\x1b[2J" in out and "\\u202eevil\\nfinding: fake" in out
        assert not _CONTROL.search(out)
        with open(os.path.join(directory, _STATE_NAME), "w", encoding="utf-8") as f:
            json.dump({**state, "findings": [0]}, f)
        code, out, err = _run(directory)
        assert code == 2 and not out and f"{_STATE_NAME} is malformed: findings[0]: expected an object, got 0" in err
    finally:
        shutil.rmtree(directory, ignore_errors=True)
