from __future__ import annotations

import io
import os
import re
import subprocess
import sys
from pathlib import Path

from gpumemd.cli import demo, main


def _demo(tmp_path, *args: str) -> list[str]:  # type: ignore[no-untyped-def]
    return _demo_run(tmp_path, *args)[0]


def _demo_run(tmp_path, *args: str) -> tuple[list[str], list[str]]:  # type: ignore[no-untyped-def]
    """The demo's stdout lines, and its stderr lines (gpumemd's own: the findings, the exit summary)."""
    proc = subprocess.run(
        [sys.executable, "-m", "gpumemd", "demo", "--output-dir", str(tmp_path), *args],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.splitlines(), proc.stderr.splitlines()


def test_demo_finds_and_names_the_planted_leak(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    lines, said = _demo_run(tmp_path)
    assert lines[0].startswith("gpumemd demo: 300 steps on cpu")
    rows = [line for line in lines if line.strip() and line.split()[0].isdigit()]
    assert [int(r.split()[0]) for r in rows] == [*range(0, 300, 20), 299]
    verdict = lines[-1]
    assert verdict.startswith("[confirmed] retained autograd graph confirmed")
    assert "held by `history` in run() at cli/demo.py" in verdict
    appended = next(n for n, line in enumerate(Path(demo.__file__).read_text().splitlines(), 1)
                    if line.strip() == "history.append(model(x))")
    assert f", appended at cli/demo.py:{appended} → " in verdict  # the line to change
    # one leak, one finding: host RSS growth that the tensor counts explain is never "cleared"
    assert [line for line in lines if line.startswith("[")] == [verdict]
    assert (tmp_path / "leak-findings-rank0.jsonl").exists()

    # the tensors column: a census after the confirmation, not the first one's figures for the whole run
    confirmed = next(int(r.split()[0]) for r in rows if r.endswith("graph_leak confirmed"))
    census_at = int(rows[-1].split("@")[1].split()[0])
    assert census_at >= confirmed - 20 and census_at > 0, rows

    # one time to OOM: the demo's verdict, the exit summary and gpumemd report say the finding's one
    to_oom = re.search(r"out of memory in (~[^(]+) \(~[\d,]+ steps\)", verdict)
    assert to_oom is not None, verdict
    exit_line = next(line for line in said if " steps watched " in line)
    assert f"out of memory in {to_oom.group(1)})" in exit_line, exit_line
    assert main(["report", str(tmp_path)]) == 0
    report = capsys.readouterr().out
    assert f"out of memory in {to_oom.group(1)} (" in report, report


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


def test_no_numpy_warning_in_gpumemds_own_commands(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """In a venv without NumPy, `import torch` warns "Failed to initialize NumPy";
    that must not be the first thing `gpumemd demo` prints (`gpumemd run` leaves it to the script)."""
    blocked = tmp_path / "no-numpy" / "numpy"
    blocked.mkdir(parents=True)
    (blocked / "__init__.py").write_text('raise ModuleNotFoundError("No module named numpy", name="numpy")\n')
    env = {**os.environ, "PYTHONPATH": str(blocked.parent)}
    torch_alone = subprocess.run([sys.executable, "-c", "import torch"], capture_output=True, text=True, env=env,
                                 timeout=120)
    assert "Failed to initialize NumPy" in torch_alone.stderr  # the setup really reproduces the warning
    demo = subprocess.run([sys.executable, "-m", "gpumemd", "demo", "--steps", "1", "--output-dir",
                           str(tmp_path / "out")], capture_output=True, text=True, env=env, timeout=300)
    assert demo.returncode == 0, demo.stderr
    assert "NumPy" not in demo.stderr and "NumPy" not in demo.stdout
