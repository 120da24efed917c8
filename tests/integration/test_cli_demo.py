from __future__ import annotations

import io
import subprocess
import sys

from gpumemd.cli import main


def _demo(tmp_path, *args: str) -> list[str]:  # type: ignore[no-untyped-def]
    proc = subprocess.run(
        [sys.executable, "-m", "gpumemd", "demo", "--output-dir", str(tmp_path), *args],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.splitlines()


def test_demo_finds_and_names_the_planted_leak(tmp_path) -> None:  # type: ignore[no-untyped-def]
    lines = _demo(tmp_path)
    assert lines[0].startswith("gpumemd demo: 300 steps on cpu")
    rows = [line for line in lines if line.strip() and line.split()[0].isdigit()]
    assert [int(r.split()[0]) for r in rows] == [*range(0, 300, 20), 299]
    verdict = lines[-1]
    assert verdict.startswith("[confirmed] retained autograd graph confirmed")
    assert "held by `history` in run() at cli/demo.py" in verdict
    # one leak, one finding: host RSS growth that the tensor counts explain is never "cleared"
    assert [line for line in lines if line.startswith("[")] == [verdict]
    assert (tmp_path / "leak-findings-rank0.jsonl").exists()


def test_demo_healthy_run_stays_quiet(tmp_path) -> None:  # type: ignore[no-untyped-def]
    lines = _demo(tmp_path, "--leak-from", "-1", "--steps", "200")
    assert lines[-1] == "no leak findings"
    assert not (tmp_path / "leak-findings-rank0.jsonl").exists()


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
