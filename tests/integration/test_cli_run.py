"""``gpumemd run``: the script runs as ``python script.py`` would, with the agent attached."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from gpumemd.cli import main
from gpumemd.cli.run import option_name
from gpumemd.config import field_docs, field_types

# The script reports what it saw into the JSON file named by its first argument, then does what
# its second argument says (exit with a code, raise, or return normally).
SCRIPT = textwrap.dedent(
    """
    import json, sys
    import gpumemd

    agent = gpumemd.current()
    seen = {
        "argv": sys.argv,
        "name": __name__,
        "path0": sys.path[0],
        "attached": agent is not None,
        "keep_steps": agent.config.keep_steps if agent else None,
        "census": agent.config.census if agent else None,
        "port": agent.config.port if agent else None,
        "output_dir": agent.output_dir if agent else None,
    }
    with open(sys.argv[1], "w") as f:
        json.dump(seen, f)
    action = sys.argv[2] if len(sys.argv) > 2 else "return"
    if action == "exit":
        sys.exit(int(sys.argv[3]))
    if action == "exit-message":
        sys.exit("fatal: config missing")
    if action == "exit-none":
        sys.exit()
    if action == "raise":
        def inner():
            raise ValueError("user bug 42")
        inner()
    if action == "interrupt":
        raise KeyboardInterrupt
    """
)


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "scripts" / "train.py"
    path.parent.mkdir()
    path.write_text(SCRIPT)
    return path


def _job_stderr(stderr: str) -> str:
    """Stderr without gpumemd's own lines (its start line and exit summary, said at attach and exit)."""
    return "".join(line for line in stderr.splitlines(keepends=True) if not line.startswith("gpumemd:"))


def _run(out_dir: str, *argv: str) -> int:
    return main(["run", "--output-dir", out_dir, "--sample-interval-s", "0", *argv])


def test_script_runs_as_main_with_its_argv_and_directory(script: Path, tmp_path: Path, out_dir: str) -> None:
    report = tmp_path / "seen.json"
    argv_before, path_before = list(sys.argv), list(sys.path)

    code = _run(out_dir, "--keep-steps", "77", "--no-census", str(script), str(report),
                "return", "--port", "5", "-m", "x", "--leak", "--help")

    assert code == 0
    seen = json.loads(report.read_text())
    # Options after the script are the script's own, even when they look like ours, or like the start
    # of several of ours (`--leak`: argparse's abbreviations once refused it as ambiguous).
    assert seen["argv"] == [str(script), str(report), "return", "--port", "5", "-m", "x", "--leak", "--help"]
    assert seen["name"] == "__main__"
    assert seen["path0"] == str(script.parent)
    assert seen["attached"] is True
    assert (seen["keep_steps"], seen["census"], seen["port"]) == (77, False, None)
    assert seen["output_dir"] == os.path.abspath(out_dir)
    # The agent is gone and the interpreter state is back as it was.
    import gpumemd

    assert gpumemd.current() is None
    assert (sys.argv, sys.path) == (argv_before, path_before)


@pytest.mark.parametrize(("action", "expected"), [("exit", 3), ("exit-none", 0), ("exit-message", 1)])
def test_exit_codes_pass_through(script: Path, tmp_path: Path, out_dir: str, *, action: str, expected: int,
                                 capsys: pytest.CaptureFixture[str]) -> None:
    extra = ["3"] if action == "exit" else []
    assert _run(out_dir, str(script), str(tmp_path / "s.json"), action, *extra) == expected
    if action == "exit-message":
        assert "fatal: config missing" in capsys.readouterr().err


def test_uncaught_exception_prints_the_scripts_traceback_and_exits_1(
    script: Path, tmp_path: Path, out_dir: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code = _run(out_dir, str(script), str(tmp_path / "s.json"), "raise")

    err = capsys.readouterr().err
    assert code == 1
    # A user's ValueError is theirs: a full traceback, not gpumemd's one-line config error.
    assert err.startswith("Traceback (most recent call last):")
    assert f'File "{script}", line' in err.splitlines()[1]  # first frame is the script, not runpy
    assert "in inner" in err
    assert err.rstrip().endswith("ValueError: user bug 42")
    assert "runpy" not in err and "gpumemd/cli/run.py" not in err


def test_keyboard_interrupt_exits_130(script: Path, tmp_path: Path, out_dir: str,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    assert _run(out_dir, str(script), str(tmp_path / "s.json"), "interrupt") == 130
    assert "KeyboardInterrupt" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--keep-steps", "many"], "--keep-steps='many' is not valid: expected an integer"),
        (["--port", "70000"], "--port=70000 is not valid: expected an integer 0-65535"),
        (["--overhead-budget", "2"], "--overhead-budget=2.0 is not valid"),
        (["--bind", "localhost:9"], "--bind='localhost:9' is not valid"),
    ],
)
def test_bad_option_is_one_line_and_exit_2(script: Path, tmp_path: Path, out_dir: str, *, argv: list[str],
                                           message: str, capsys: pytest.CaptureFixture[str]) -> None:
    seen = tmp_path / "s.json"
    assert _run(out_dir, *argv, str(script), str(seen)) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("gpumemd run: ") and message in err
    assert not seen.exists()  # the script never ran


def test_environment_sets_options_and_command_line_wins(script: Path, tmp_path: Path, out_dir: str,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUMEMD_KEEP_STEPS", "55")
    monkeypatch.setenv("GPUMEMD_CENSUS", "off")
    report = tmp_path / "seen.json"
    assert _run(out_dir, str(script), str(report)) == 0
    assert json.loads(report.read_text())["keep_steps"] == 55
    assert json.loads(report.read_text())["census"] is False

    assert _run(out_dir, "--keep-steps", "66", "--census", str(script), str(report)) == 0
    assert json.loads(report.read_text())["keep_steps"] == 66
    assert json.loads(report.read_text())["census"] is True


def test_bad_environment_variable_names_the_variable(script: Path, tmp_path: Path, out_dir: str,
                                                     monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("GPUMEMD_KEEP_STEPS", "lots")
    assert _run(out_dir, str(script), str(tmp_path / "s.json")) == 2
    assert "GPUMEMD_KEEP_STEPS='lots' is not valid" in capsys.readouterr().err


def test_module_form_runs_like_python_dash_m(script: Path, tmp_path: Path, out_dir: str,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(script.parent)
    report = tmp_path / "seen.json"
    assert _run(out_dir, "-m", "train", str(report), "exit", "4") == 4
    seen = json.loads(report.read_text())
    assert seen["argv"] == [str(script), str(report), "exit", "4"]  # argv[0] is the module's file
    assert seen["name"] == "__main__" and seen["attached"] is True
    assert seen["path0"] == str(script.parent)


def test_nothing_or_a_missing_script_is_a_usage_error(tmp_path: Path, out_dir: str,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    assert _run(out_dir) == 2
    assert "nothing to run" in capsys.readouterr().err
    assert _run(out_dir, str(tmp_path / "missing.py")) == 2
    assert "missing.py" in capsys.readouterr().err


def test_missing_module_and_a_directory_are_one_line_and_exit_2(tmp_path: Path, out_dir: str,
                                                                 monkeypatch: pytest.MonkeyPatch,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    for module in ("no_such_module", "no_such_package.train"):
        assert _run(out_dir, "-m", module) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"no module named {module!r}" in err, err
    (tmp_path / "scripts").mkdir()
    assert _run(out_dir, str(tmp_path / "scripts")) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is a directory with no __main__.py" in err, err


def test_a_directory_with_main_runs_as_python_runs_it(tmp_path: Path, out_dir: str) -> None:
    app = tmp_path / "app"
    app.mkdir()
    (app / "__main__.py").write_text("import sys\nsys.exit(7)\n", encoding="utf-8")
    assert _run(out_dir, str(app)) == 7


def test_every_config_field_is_an_option(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "--help"]) == 0
    help_text = " ".join(capsys.readouterr().out.split())
    for name, kind in field_types().items():
        assert option_name(name) in help_text, name
        assert f"GPUMEMD_{name.upper()}" in help_text, name
        if kind is bool:
            assert "--no-" + option_name(name)[2:] in help_text, name
    assert len(field_docs()) == len(field_types())


def test_old_option_names_still_work_with_one_deprecation_line(tmp_path: Path, out_dir: str,
                                                                caplog: pytest.LogCaptureFixture,
                                                                capsys: pytest.CaptureFixture[str],
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    import gpumemd.log_once

    monkeypatch.setattr(gpumemd.log_once, "_logged", set())  # said once per process: none said yet
    caplog.set_level(logging.WARNING, logger="gpumemd")
    script, seen = tmp_path / "config.py", tmp_path / "config.json"
    script.write_text("import json, sys, gpumemd\nc = gpumemd.current().config\n"
                      "json.dump([c.keep_steps, c.step_profile, c.step_profile_every_steps], open(sys.argv[1], 'w'))\n")

    assert _run(out_dir, "--history-steps", "12", "--phases", "--phase-every-steps", "3", str(script), str(seen)) == 0

    assert json.loads(seen.read_text()) == [12, True, 3]
    assert [r.getMessage() for r in caplog.records if "deprecated" in r.getMessage()] == [
        "gpumemd: --history-steps is deprecated; use --keep-steps (same meaning)",
        "gpumemd: --phases is deprecated; use --step-profile (same meaning)",
        "gpumemd: --phase-every-steps is deprecated; use --step-profile-every-steps (same meaning)",
    ]
    assert _run(out_dir, "--no-phases", "--keep-steps", "5", "--history-steps", "6", str(script), str(seen)) == 0
    assert json.loads(seen.read_text()) == [5, False, 50]  # the name now wins
    assert _run(out_dir, "--history-steps", "many", str(script), str(seen)) == 2
    assert "--history-steps='many' is not valid: expected an integer" in capsys.readouterr().err
    assert main(["run", "--help"]) == 0
    assert "--history-steps" not in capsys.readouterr().out  # out of --help


def test_real_process_exit_code_and_traceback(script: Path, tmp_path: Path, out_dir: str) -> None:
    """``python -m gpumemd run`` in a fresh interpreter: what a launcher (torchrun, srun) sees."""
    env = {**os.environ, "GPUMEMD_SAMPLE_INTERVAL_S": "0", "GPUMEMD_OUTPUT_DIR": out_dir}
    raised = subprocess.run(
        [sys.executable, "-m", "gpumemd", "run", str(script), str(tmp_path / "a.json"), "raise"],
        capture_output=True, text=True, env=env, timeout=120,
    )
    assert raised.returncode == 1, raised.stderr
    assert _job_stderr(raised.stderr).rstrip().endswith("ValueError: user bug 42")
    assert json.loads((tmp_path / "a.json").read_text())["attached"] is True

    exited = subprocess.run(
        [sys.executable, "-m", "gpumemd", "run", "--keep-steps", "12", str(script),
         str(tmp_path / "b.json"), "exit", "7"],
        capture_output=True, text=True, env=env, timeout=120,
    )
    assert exited.returncode == 7, exited.stderr
    assert json.loads((tmp_path / "b.json").read_text())["keep_steps"] == 12


def test_a_script_cannot_tell_gpumemd_run_from_python(tmp_path: Path, out_dir: str) -> None:
    """``__file__`` absolute (the script chdirs, then reads next to itself), ``sys.argv[0]`` as typed, and an
    uncaught KeyboardInterrupt kills the process by SIGINT, traceback and all, as with ``python``."""
    scripts = tmp_path / "job"
    scripts.mkdir()
    (scripts / "data.txt").write_text("next to the script")
    (scripts / "train.py").write_text(textwrap.dedent(
        """
        import os, sys
        here = os.path.dirname(__file__)
        os.chdir("/")
        with open(os.path.join(here, "data.txt")) as f:
            print(os.path.isabs(__file__), sys.argv[0], f.read())
        if sys.argv[1:] == ["interrupt"]:
            raise KeyboardInterrupt
        """
    ))
    env = {**os.environ, "GPUMEMD_SAMPLE_INTERVAL_S": "0", "GPUMEMD_OUTPUT_DIR": out_dir}
    for args in ([], ["interrupt"]):
        plain = subprocess.run([sys.executable, "job/train.py", *args], cwd=tmp_path, capture_output=True,
                               text=True, env=env, timeout=120)
        watched = subprocess.run([sys.executable, "-m", "gpumemd", "run", "job/train.py", *args], cwd=tmp_path,
                                 capture_output=True, text=True, env=env, timeout=120)
        assert watched.stdout == plain.stdout == "True job/train.py next to the script\n"  # argv[0] as typed
        assert watched.returncode == plain.returncode == (-signal.SIGINT if args else 0), watched.stderr
        if args:
            assert plain.stderr.rstrip().endswith("KeyboardInterrupt")
            assert _job_stderr(watched.stderr).rstrip().endswith("KeyboardInterrupt")
