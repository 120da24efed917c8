"""exporters/slurm/gpumemd_file_sd.py: Slurm allocation -> Prometheus file_sd targets."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "exporters" / "slurm" / "gpumemd_file_sd.py"


@pytest.fixture(scope="module")
def sd() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpumemd_file_sd", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    ("hostlist", "hosts"),
    [
        ("node1", ["node1"]),
        ("gpu[01-03,10]", ["gpu01", "gpu02", "gpu03", "gpu10"]),
        ("a[8-10],login", ["a8", "a9", "a10", "login"]),
        ("rack[1-2]-n[09-10]", ["rack1-n09", "rack1-n10", "rack2-n09", "rack2-n10"]),
        ("x[007]-ib", ["x007-ib"]),
    ],
)
def test_expand_hostlist(sd: ModuleType, hostlist: str, hosts: list[str]) -> None:
    assert sd.expand_hostlist(hostlist) == hosts


@pytest.mark.parametrize("bad", ["gpu[01-", "gpu01]", "gpu[a-b]", "gpu[5-1]", "n[1-99999999]"])
def test_bad_hostlists_are_errors(sd: ModuleType, bad: str) -> None:
    with pytest.raises(ValueError, match="hostlist"):
        sd.expand_hostlist(bad)


def test_tasks_per_node(sd: ModuleType) -> None:
    assert sd.expand_tasks_per_node("4(x2),2", 3) == [4, 4, 2]
    assert sd.expand_tasks_per_node("8", 3) == [8, 8, 8]
    with pytest.raises(ValueError, match="2 counts for 3 nodes"):
        sd.expand_tasks_per_node("1,2", 3)
    with pytest.raises(ValueError, match="not N or N"):
        sd.expand_tasks_per_node("4x2", 1)


def test_targets_are_port_plus_local_rank_per_node(sd: ModuleType) -> None:
    groups = sd.targets(["a", "b"], [2, 1], 9400, {"training_job": "llm"})
    assert groups == [
        {"targets": ["a:9400", "a:9401"], "labels": {"training_job": "llm", "node": "a"}},
        {"targets": ["b:9400"], "labels": {"training_job": "llm", "node": "b"}},
    ]
    with pytest.raises(ValueError, match="past port 65535"):
        sd.targets(["a"], [4], 65534, {})


def test_job_environment_to_file_and_removal(sd: ModuleType, tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no scontrol here: the built-in expander is used
    env = {"SLURM_JOB_NODELIST": "gpu[1-2]", "SLURM_TASKS_PER_NODE": "2(x2)", "GPUMEMD_PORT": "9500",
           "SLURM_JOB_NAME": "pretrain", "SLURM_JOB_ID": "4242"}
    out = tmp_path / "gpumemd-4242.json"

    assert sd.main(["--output", str(out)], env=env) == 0

    groups = json.loads(out.read_text())
    assert [g["targets"] for g in groups] == [["gpu1:9500", "gpu1:9501"], ["gpu2:9500", "gpu2:9501"]]
    assert groups[0]["labels"] == {"training_job": "pretrain", "slurm_job_id": "4242", "node": "gpu1"}
    assert [p.name for p in tmp_path.iterdir()] == [out.name]  # no temp file left behind
    assert sd.main(["--output", str(out), "--remove"], env=env) == 0
    assert not out.exists()


def test_scontrol_is_preferred_when_installed(tmp_path: Path) -> None:
    fake = tmp_path / "scontrol"  # stands in for Slurm's own expander at the process boundary
    fake.write_text("#!/bin/sh\n[ \"$1 $2\" = 'show hostnames' ] && printf 'n-%s\\n' a b\n")
    fake.chmod(0o755)
    env = {"PATH": f"{tmp_path}{os.pathsep}{os.environ['PATH']}", "SLURM_JOB_NODELIST": "n-[a,b]"}
    done = subprocess.run([sys.executable, str(SCRIPT), "--tasks-per-node", "1", "--port", "9400"],
                          capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 0, done.stderr
    assert [g["targets"] for g in json.loads(done.stdout)] == [["n-a:9400"], ["n-b:9400"]]


def test_no_nodelist_is_one_line_exit_2(sd: ModuleType, capsys: pytest.CaptureFixture[str]) -> None:
    assert sd.main([], env={}) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--nodelist" in err
