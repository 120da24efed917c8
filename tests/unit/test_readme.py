"""The README is the newcomer's contract: its generated tables match the code, and CI runs its test command."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_generated_tables_match_the_code() -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "readme_tables.py"), "--check"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_ci_runs_the_readme_test_command_verbatim() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    blocks = re.findall(r"```bash\n(.*?)\n```", readme, re.S)
    quickstart = [b for b in blocks if "pytest" in b]
    assert quickstart, "the README has no test command"
    command = quickstart[0].strip()
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert command in ci.splitlines()


def test_quickstart_is_exactly_two_commands() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = readme[readme.index("## Quickstart"):readme.index("## Contents")]
    commands = re.findall(r"```bash\n(.*?)\n```", section, re.S)
    assert len(commands) == 2 and all("\n" not in c.strip() for c in commands)
    assert commands[0].strip().endswith("gpumemd demo")
    assert commands[1].strip().endswith("python -m pytest")
