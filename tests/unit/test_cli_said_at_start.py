"""Newcomer mistakes said once, at start, with the fix: a mistyped ``gpumemd run`` option names the close
ones, and a mistyped GPUMEMD_* variable is warned about once however many times the config is built."""

from __future__ import annotations

import logging

import pytest

from gpumemd.cli import main
from gpumemd.config import Config


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
