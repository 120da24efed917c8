"""The README is the newcomer's contract: the generated tables in docs/ match the code, CI runs its test
command, and every command of its tour runs and prints what it shows."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_generated_tables_match_the_code() -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "doc_tables.py"), "--check"],
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
    section = readme[readme.index("## Quickstart"):readme.index("## A five-minute tour")]
    commands = re.findall(r"```bash\n(.*?)\n```", section, re.S)
    assert len(commands) == 2 and all("\n" not in c.strip() for c in commands)
    assert commands[0].strip().endswith("gpumemd demo")
    assert commands[1].strip().endswith("python -m pytest")


# --- the tour: every command runs, and prints what the README shows ---------------------------

TOUR_DIR = "/path/to/project"  # the README's stand-in for the directory the tour runs in
_NUMBER = re.compile(r"\d[\d,.]*")


def _tour_blocks(readme: str) -> tuple[dict[str, str], list[tuple[str, list[str]]]]:
    """The files the tour writes (``<!-- file: NAME -->`` before a python block) and its console
    blocks as (command, shown output lines) pairs, in order."""
    tour = readme[readme.index("## A five-minute tour"):readme.index("## Documentation")]
    files = dict(re.findall(r"<!-- file: (\S+) -->\n```python\n(.*?)```", tour, re.S))
    commands: list[tuple[str, list[str]]] = []
    for block in re.findall(r"```console\n(.*?)```", tour, re.S):
        for line in block.splitlines():
            if line.startswith("$ "):
                commands.append((line[2:], []))
            else:
                commands[-1][1].append(line)
    return files, commands


def _pattern(shown: str) -> re.Pattern[str]:
    """A shown line as a pattern over a real line: numbers stand for any number (pids, timings,
    step counts differ per run) and "…" for any text."""
    parts = [re.escape(_NUMBER.sub("N", piece)) for piece in shown.split("…")]
    return re.compile("^" + ".*".join(parts) + "$")


def _unmatched(shown: list[str], real: list[str]) -> list[str]:
    """Shown lines not found, in order, among the real ones ("…" alone skips any number of lines)."""
    real_n = [_NUMBER.sub("N", line) for line in real]
    at, missing = 0, []
    for line in (s for s in shown if s.strip() and s.strip() != "…"):
        pattern = _pattern(line)
        hit = next((i for i in range(at, len(real_n)) if pattern.match(real_n[i])), None)
        if hit is None:
            missing.append(line)
        else:
            at = hit + 1
    return missing


def test_the_tour_runs_as_shown(tmp_path: pathlib.Path) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("the tour's outputs are shown from a CPU-only machine; with CUDA the start line differs")
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    files, commands = _tour_blocks(readme)
    assert set(files) == {"train.py", "oom.py"} and len(commands) >= 5
    project = tmp_path / "project"
    project.mkdir()
    for name, text in files.items():
        (project / name).write_text(text)
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUMEMD_")}
    env["PATH"] = f"{pathlib.Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"  # the venv's gpumemd
    for command, shown in commands:
        proc = subprocess.run(["bash", "-c", command + " 2>&1"], cwd=project, env=env, capture_output=True,
                              text=True, timeout=300)
        real = proc.stdout.replace(str(project), TOUR_DIR).splitlines()
        missing = _unmatched(shown, real)
        assert not missing, (f"`{command}` printed:\n" + "\n".join(real)
                             + "\n\nnot found, in order:\n" + "\n".join(missing))


def test_readme_is_a_guide_and_its_links_resolve() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= 350
    for target in re.findall(r"\]\(((?:docs/)?[\w./-]+\.md|LICENSE)(?:#[\w-]+)?\)", readme):
        assert (ROOT / target).is_file(), target
    for page in (ROOT / "docs").glob("*.md"):
        for target in re.findall(r"\]\(([\w./-]+\.md)(?:#[\w-]+)?\)", page.read_text(encoding="utf-8")):
            assert (page.parent / target).is_file(), f"{page.name} links to {target}"
