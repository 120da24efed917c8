"""The job scripts ``tests/gpu`` runs in fresh interpreters are strings, out of mypy's sight: on a CPU
machine, each one must still compile and use only what gpumemd has (``gpumemd.X``, ``agent.X`` for the
agent ``attach()`` returns, ``agent.state().X``), so an API change that breaks them fails here, not on
the next lent GPU."""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import textwrap
from pathlib import Path

import pytest

import gpumemd
from gpumemd.agent import Agent
from gpumemd.records.step import AgentState

GPU_TESTS = Path(__file__).resolve().parents[1] / "gpu"


def _scripts() -> dict[str, str]:
    """Every module-level string of tests/gpu that is a job script (it imports torch or calls gpumemd)."""
    out: dict[str, str] = {}
    for path in sorted(GPU_TESTS.glob("test_*.py")):
        spec = importlib.util.spec_from_file_location(f"_gpu_{path.stem}", path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        prelude = getattr(module, "PRELUDE", "")
        for name, value in vars(module).items():
            if isinstance(value, str) and name.isupper() and ("gpumemd." in value or "import torch" in value):
                out[f"{path.stem}.{name}"] = value if name == "PRELUDE" else prelude + textwrap.dedent(value)
    return out


SCRIPTS = _scripts()


def _uses(tree: ast.AST, owner: str) -> set[str]:
    return {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name) and node.value.id == owner}


def _state_uses(tree: ast.AST) -> set[str]:
    """``X`` in ``agent.state().X``."""
    return {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Call) and isinstance(node.value.func, ast.Attribute)
            and node.value.func.attr == "state"}


def test_the_gpu_tests_have_job_scripts() -> None:
    assert len(SCRIPTS) >= 8, sorted(SCRIPTS)  # the check below looks at something


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_a_gpu_job_script_compiles_and_uses_only_what_gpumemd_has(name: str) -> None:
    tree = ast.parse(SCRIPTS[name], filename=name)
    compile(tree, name, "exec")
    assert not {a for a in _uses(tree, "gpumemd") if not hasattr(gpumemd, a)} - {"records"}, name  # lazy names
    assert not _uses(tree, "agent") - set(dir(Agent)), name
    state_fields = {f.name for f in dataclasses.fields(AgentState)} | set(dir(AgentState))
    assert not _state_uses(tree) - state_fields, name
