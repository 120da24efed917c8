"""Newcomer mistakes said once, at start, with the fix: a mistyped ``gpumemd run`` option names the close
ones, a mistyped GPUMEMD_* variable is warned about once however many times the config is built, and an
output directory that cannot be written is said in the start line (and by ``doctor``), with the
temporary directory used instead."""

from __future__ import annotations

import logging
import os
import tempfile
from typing import Any

import pytest

import gpumemd
from gpumemd.api import build_agent
from gpumemd.cli import main
from gpumemd.config import Config
from gpumemd.output_dir import FALLBACK_PREFIX, output_dir_problem
from gpumemd.records.step import Identity


def test_a_mistyped_run_option_suggests_the_real_one(capsys: pytest.CaptureFixture[str], tmp_path: object) -> None:
    code = main(["run", "--prot", "9400", "train.py"])

    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("gpumemd run: unrecognized option: --prot (did you mean --port?)")
    assert "Traceback" not in err and "usage: gpumemd [-h]" not in err  # not the top-level usage


def test_other_commands_still_refuse_unknown_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["report", "--bogus", "x"]) == 2
    assert "unrecognized arguments: --bogus" in capsys.readouterr().err


def test_a_mistyped_variable_is_warned_once(caplog: pytest.LogCaptureFixture) -> None:
    env = {"GPUMEMD_SAMPLE_INTERVALL_S": "1"}  # a name no other test uses: the warning is once per process
    with caplog.at_level(logging.WARNING, logger="gpumemd"):
        Config.from_sources(env)  # `gpumemd run` validates its options ...
        Config.from_sources(env)  # ... then attach() builds the config again

    lines = [r.getMessage() for r in caplog.records if "GPUMEMD_SAMPLE_INTERVALL_S" in r.getMessage()]
    assert lines == ["gpumemd: GPUMEMD_SAMPLE_INTERVALL_S is not a gpumemd option (did you mean "
                     "GPUMEMD_SAMPLE_INTERVAL_S?); ignored"]


# --- an output directory that cannot be written: said at start, with the fallback ------------------


def test_an_unwritable_output_dir_is_said_at_start_and_a_temporary_one_used(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the fallback lands in this test's directory
    blocker = tmp_path / "file.txt"
    blocker.write_text("a file, not a directory")  # under a regular file: unwritable for root too
    wanted = blocker / "out"
    caplog.set_level(logging.INFO, logger="gpumemd.status")
    with gpumemd.attached(output_dir=str(wanted)) as agent:
        written = agent.output_dir
    [start] = [r.getMessage() for r in caplog.records if r.name == "gpumemd.status" and "watching" in r.getMessage()]
    assert os.path.dirname(written) == str(tmp_path) and os.path.basename(written).startswith(FALLBACK_PREFIX)
    assert os.path.isdir(written) and not wanted.exists()
    assert (f" · output {written} (a temporary directory: {wanted} cannot be created, {blocker} is not a "
            "directory) · ") in start


def test_another_rank_warns_of_the_fallback_in_its_log(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    (tmp_path / "f").write_text("")
    with caplog.at_level(logging.WARNING, logger="gpumemd"):
        agent = build_agent(Config(output_dir=str(tmp_path / "f" / "out")), identity=Identity(rank=3, world_size=4))
        agent.start()
        agent.stop()
    [line] = [r.getMessage() for r in caplog.records if "a temporary directory" in r.getMessage()]
    assert line == (f"gpumemd[rank 3/4]: output {agent.output_dir} (a temporary directory: {tmp_path / 'f' / 'out'} "
                    f"cannot be created, {tmp_path / 'f'} is not a directory)")


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux's /proc")
def test_doctor_names_the_directory_that_cannot_be_made_and_why(capsys: pytest.CaptureFixture[str]) -> None:
    assert output_dir_problem("/proc/nope") == ("/proc/nope cannot be created, /proc takes no new files: "
                                                "No such file or directory")
    assert main(["doctor", "--output-dir", "/proc/nope"]) == 1
    [line] = [x for x in capsys.readouterr().out.splitlines() if x.startswith("fail  output dir")]
    assert "/proc/nope cannot be created, /proc takes no new files" in line
    assert "the agent would write to a temporary directory instead (its start line names it)" in line
