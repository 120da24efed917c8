"""``gpumemd top``'s frame from parsed state files (``report.top_frame``: worst first, vanished vs ended, the
findings in their own words, a bounded history), and the command's one-shot outputs and refusals."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from gpumemd.cli import main
from gpumemd.cli.top import sparkline
from gpumemd.report.top_frame import History, frame

GiB = 1024**3


def doc(rank: int, **changes: Any) -> dict[str, Any]:
    return {"schema": 1, "pid": 1000 + rank, "rank": rank, "world_size": 4, "hostname": "node7",
            "attached_at": 1e9, "written_at": 1e9 + 600, "step": 4100, "steps_total": 4101, "phase": "train",
            "seconds_per_step": 0.25, "_file": f"/out/gpumemd-state-rank{rank}.json",
            "allocator": [{"device": 0, "allocated_bytes": 30 * GiB, "reserved_bytes": 34 * GiB,
                           "peak_bytes": 36 * GiB, "cap_bytes": None}],
            "headroom": [{"where": "cuda:0", "free_bytes": 40 * GiB, "total_bytes": 80 * GiB},
                         {"where": "host", "free_bytes": 50 * GiB, "total_bytes": 64 * GiB, "rss_bytes": 6 * GiB,
                          "limit": "the cgroup memory limit"}],
            "workers": {"count": 4, "rss_bytes": 2 * GiB},
            "tensors": {"step": 4000, "tensor_count": 900, "total_bytes": 20 * GiB, "groups": [
                {"device": "cuda:0", "dtype": "torch.float32", "shape": [4096, 4096], "category": "other",
                 "name": None, "count": 100, "nbytes": 6 * GiB, "graph_bytes": 0, "holder": "list `kept`"},
                {"device": "cuda:0", "dtype": "torch.bfloat16", "shape": [4096], "category": "parameter",
                 "name": "layer.weight", "count": 1, "nbytes": 8192, "graph_bytes": 0, "holder": None}]},
            "findings": [], "findings_more": 0, "ooms_total": 0, "reports": [], "ended": None, "ended_at": None,
            **changes}


LEAK = {"state": "confirmed", "kind": "tensor_leak", "series": "allocated_bytes{device=0}", "device": 0,
        "slope_bytes_per_step": 64 * 1024, "growth_bytes": GiB, "steps_to_oom": 120.0, "hours_to_oom": 0.01,
        "updated_step": 4000, "headline": "tensor leak confirmed: held by `kept`", "summary": "..."}


def test_the_frame_puts_the_worst_rank_first_and_tells_vanished_from_ended() -> None:
    docs = [doc(0), doc(1, findings=[{**LEAK, "state": "suspected"}]), doc(2, findings=[LEAK]),
            doc(3, ended="SIGTERM", ended_at=1e9 + 601, findings=[LEAK]), doc(4)]
    alive = {d["_file"]: d["rank"] != 4 for d in docs}  # rank 4's pid is gone; rank 3 ended cleanly
    view = frame(docs, alive=alive, now=1e9 + 602, history=History())
    assert [r["rank"] for r in view["ranks"]] == [4, 2, 1, 0, 3]
    assert [r["status"] for r in view["ranks"]] == ["vanished", "running", "running", "running", "ended"]
    assert (view["running"], view["vanished"], view["ended"]) == (3, 1, 1)
    vanished, leaking = view["ranks"][0], view["ranks"][1]
    assert vanished["ending"].startswith("VANISHED: no clean exit recorded")
    assert view["ranks"][-1]["ending"].startswith("ended by SIGTERM")
    assert leaking["age_s"] == 2.0 and leaking["step"] == 4100
    [finding] = leaking["findings"]  # the words the finding's own line and `gpumemd report` use
    assert (finding["rate"], finding["to_oom"]) == ("+64.0 KiB/step", "~36 s (~120 steps)")
    assert finding["said"] == "tensor leak confirmed: held by `kept`"
    cuda, host = leaking["memory"]
    assert (cuda["used_bytes"], cuda["limit_bytes"], cuda["limit"]) == (30 * GiB, 80 * GiB, "the device's total")
    assert (host["used_bytes"], host["limit_bytes"], host["limit"]) == (6 * GiB, 64 * GiB, "the cgroup memory limit")
    assert [(g["bytes"], g["held_by"]) for g in leaking["tensor_groups"]] == [(6 * GiB, "list `kept`"),
                                                                              (8192, "layer.weight")]


def test_a_cap_is_the_bar_limit_and_the_least_headroom_comes_first() -> None:
    capped = doc(1, allocator=[{"device": 0, "allocated_bytes": 30 * GiB, "reserved_bytes": 31 * GiB,
                                "peak_bytes": 31 * GiB, "cap_bytes": 32 * GiB}])
    view = frame([doc(0), capped], alive={}, now=1e9 + 600, history=History())
    assert [r["rank"] for r in view["ranks"]] == [1, 0]  # another host (alive unknown): still running
    assert view["ranks"][0]["memory"][0]["limit"] == "the per-process cap"


def test_the_history_is_one_point_per_write_and_bounded() -> None:
    history = History(points=3)
    for n in range(5):
        d = doc(0, written_at=1e9 + n, allocator=[{"device": 0, "allocated_bytes": n * GiB}])
        history.add(d)
        history.add(d)  # the same file read again adds nothing
    assert history.values("/out/gpumemd-state-rank0.json", "cuda:0") == [2 * GiB, 3 * GiB, 4 * GiB]
    assert sparkline([0, 1, 2, 3, 4, 5, 6, 7], 8) == "▁▂▃▄▅▆▇█" and sparkline([5, 1, 9], 2) == "▁█"


def write(out: Path, d: dict[str, Any]) -> None:
    out.mkdir(exist_ok=True)
    body = {k: v for k, v in d.items() if k != "_file"}
    (out / f"gpumemd-state-rank{d['rank']}.json").write_text(json.dumps(body))


def test_once_and_json_print_one_frame(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NO_COLOR", "1")
    hostile = {**LEAK, "headline": "held by `kept`\x1b[2J"}
    write(tmp_path, doc(0, pid=os.getpid(), hostname=os.uname().nodename, findings=[hostile]))
    assert main(["top", "--once", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert "rank 0  RUNNING" in text and "allocated 30.00 GiB  reserved 34.00 GiB  peak 36.00 GiB" in text
    assert "workers 4 child processes, RSS " in text and "held by list `kept`" in text  # any child: not "DataLoader"
    assert "held by `kept`\\x1b[2J" in text and "\x1b" not in text  # escaped, and no colour off a terminal
    assert main(["top", "--json", str(tmp_path)]) == 0
    [rank] = json.loads(capsys.readouterr().out)["ranks"]
    assert rank["status"] == "running" and rank["findings"][0]["to_oom"] == "~36 s (~120 steps)"


@pytest.mark.parametrize(("args", "said"), [
    (["top", "{tmp}/missing"], "missing is not a directory: pass a job's output directory"),
    (["top", "{tmp}"], "nothing to watch: no gpumemd-state-rank<R>.json in"),
    (["top", "--interval", "0", "{tmp}"], "--interval=0.0 is not valid"),
    (["top", "--bogus"], "unrecognized arguments: --bogus"),
])
def test_bad_arguments_and_nothing_to_watch_are_one_line_and_exit_2(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], said: str) -> None:
    assert main([a.format(tmp=tmp_path) for a in args]) == 2
    err = capsys.readouterr().err
    assert said in err and "Traceback" not in err


def test_the_live_view_needs_a_terminal(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write(tmp_path, doc(0))
    assert main(["top", str(tmp_path)]) == 2
    assert "the live view needs a terminal: use --once or --json" in capsys.readouterr().err
