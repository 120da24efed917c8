from __future__ import annotations

import io
import subprocess
import sys

from gpumemd.cli import main


def test_demo_runs_and_prints_a_table(tmp_path) -> None:  # type: ignore[no-untyped-def]
    proc = subprocess.run(
        [sys.executable, "-m", "gpumemd", "demo", "--steps", "12", "--output-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("gpumemd demo: 12 steps on cpu")
    assert "host RSS" in lines[1]
    rows = [line for line in lines[2:] if line.strip() and line.split()[0].isdigit()]
    assert [int(r.split()[0]) for r in rows] == [0, 10, 11]


def test_demo_rejects_bad_arguments_with_exit_2(capsys) -> None:  # type: ignore[no-untyped-def]
    assert main(["demo", "--steps", "0"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == "gpumemd demo: --steps=0 is not valid: expected an integer >= 1"
    assert "Traceback" not in err


def test_unknown_command_exits_2() -> None:
    stderr = io.StringIO()
    sys_stderr, sys.stderr = sys.stderr, stderr
    try:
        assert main(["frobnicate"]) == 2
    finally:
        sys.stderr = sys_stderr
    assert "invalid choice" in stderr.getvalue()
