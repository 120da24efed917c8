"""``gpumemd export`` and the wheel: the dashboard, rules and scrape configs ship with the package.

What ``gpumemd export`` writes must pass promtool and the dashboard checks of test_grafana_dashboard.py,
must not clobber a file without ``--force``, and a non-editable wheel must carry the files (and LICENSE)
and find them inside itself, not in a checkout.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import test_grafana_dashboard as dashboard_checks
from prom_binaries import require_binary

from gpumemd import artifacts
from gpumemd.cli import main

ROOT = Path(__file__).resolve().parents[2]


def export(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, list[str], list[str]]:
    code = main(["export", *argv])
    captured = capsys.readouterr()
    return code, captured.out.splitlines(), captured.err.splitlines()


def promtool(*args: str, cwd: Path) -> None:
    result = subprocess.run([require_binary("promtool"), *args], cwd=cwd, capture_output=True, timeout=60)
    assert result.returncode == 0, result.stdout.decode() + result.stderr.decode()


def test_exported_prometheus_files_pass_promtool(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "prom"
    code, lines, err = export(capsys, "prometheus", str(out))
    assert code == 0 and not err
    expected = [a.target for a in artifacts.FILES["prometheus"]]
    assert [line.removeprefix(f"wrote {out}{os.sep}") for line in lines[:-1]] == expected
    assert lines[-1].startswith(f"next: promtool check rules {out / 'rules' / 'gpumemd.rules.yml'}")
    for a in artifacts.FILES["prometheus"]:  # copies, byte for byte, of the one source of truth
        assert (out / a.target).read_bytes() == (ROOT / a.source).read_bytes(), a.target
    assert os.access(out / "file_sd" / "write_targets.sh", os.X_OK)
    assert not os.access(out / "rules" / "gpumemd.rules.yml", os.X_OK)

    promtool("check", "rules", str(out / "rules" / "gpumemd.rules.yml"), cwd=tmp_path)
    promtool("test", "rules", str(out / "rules" / "gpumemd.rules.test.yml"), cwd=tmp_path)  # from elsewhere
    promtool("check", "config", "prometheus.yml", "prometheus-file-sd.yml", cwd=out)


@pytest.fixture(scope="module")
def exported_grafana(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("grafana")
    assert main(["export", "grafana", str(out)]) == 0
    return out


# test_grafana_dashboard.py's checks, run on the exported files instead of the repository's. Not its
# generator check (the generator is not exported; the bytes are compared with the checked JSON below).
DASHBOARD_CHECKS: list[tuple[str, dict[str, Any]]] = [
    ("test_file_provisioning_can_load_it_as_is", {}),
    ("test_templated_datasource", {}),
    *[("test_query_variables", {"name": n}) for n in ("job", "instance", "rank", "device")],
    ("test_dashboard_is_not_editable_in_the_ui", {}),
    ("test_rows_cover_the_story", {}),
    ("test_every_panel_titled_described_and_on_the_datasource_variable", {}),
    ("test_units", {}),
    ("test_every_selector_filters_job_and_instance", {}),
    ("test_rates_use_rate_interval", {}),
    ("test_every_metric_a_query_names_is_really_emitted", {}),
    ("test_unique_ids_and_panels_inside_the_grid", {}),
    ("test_provisioning_files", {}),
    ("test_headline_panels_show_host_memory_on_a_cpu_job", {}),
    ("test_every_query_parses_as_promql", {"tmp_path": None}),  # needs promtool
    ("test_device_headroom_counts_the_allocator_cache_as_free", {"tmp_path": None}),
    ("test_leak_state_reads_healthy_without_a_finding", {"tmp_path": None}),
    ("test_leak_slope_is_bytes_per_step", {}),
    ("test_time_since_the_last_step_is_on_the_dashboard", {}),
    ("test_firing_gpumemd_alerts_are_annotations", {"tmp_path": None}),
    ("test_a_training_job_variable_picks_one_job_among_many", {"tmp_path": None}),
    ("test_cuda_only_panels_say_so_on_a_job_without_cuda", {}),
    ("test_projected_time_to_oom_is_time", {}),
]


NOT_ON_THE_EXPORT = {"test_committed_json_is_what_the_generator_writes", "test_a_broken_query_would_be_caught"}
CHECK_IDS = [check.removeprefix("test_") + (f"-{kw['name']}" if "name" in kw else "") for check, kw in DASHBOARD_CHECKS]


@pytest.mark.parametrize(("check", "kwargs"), DASHBOARD_CHECKS, ids=CHECK_IDS)
def test_exported_dashboard_passes_the_dashboard_checks(
    exported_grafana: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, check: str, kwargs: dict[str, Any]
) -> None:
    import json

    text = (exported_grafana / "dashboards" / "gpumemd.json").read_text()
    assert text == (ROOT / "grafana" / "dashboards" / "gpumemd.json").read_text()
    dashboard = json.loads(text)
    monkeypatch.setattr(dashboard_checks, "GRAFANA", exported_grafana)
    monkeypatch.setattr(dashboard_checks, "DASHBOARD", dashboard)
    monkeypatch.setattr(dashboard_checks, "PANELS", [p for p in dashboard["panels"] if p["type"] != "row"])
    monkeypatch.setattr(dashboard_checks, "ROWS", [p for p in dashboard["panels"] if p["type"] == "row"])
    monkeypatch.setattr(dashboard_checks, "VARS", {v["name"]: v for v in dashboard["templating"]["list"]})
    function: Callable[..., None] = getattr(dashboard_checks, check)
    function(**{k: (tmp_path if k == "tmp_path" else v) for k, v in kwargs.items()})


def test_no_dashboard_check_is_forgotten() -> None:
    checks = {name for name in vars(dashboard_checks) if name.startswith("test_")}
    assert checks - NOT_ON_THE_EXPORT == {check for check, _ in DASHBOARD_CHECKS}


def test_refuses_to_overwrite_without_force(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert export(capsys, "grafana", str(tmp_path))[0] == 0
    mine = tmp_path / "provisioning" / "datasources" / "gpumemd.yaml"
    mine.write_text("# my edited datasource\n")
    (tmp_path / "dashboards" / "gpumemd.json").unlink()

    code, out, err = export(capsys, "grafana", str(tmp_path))
    assert code == 2 and out == []
    assert len(err) == 1 and str(tmp_path / "provisioning") in err[0] and "--force" in err[0], err
    assert mine.read_text() == "# my edited datasource\n"
    assert not (tmp_path / "dashboards" / "gpumemd.json").exists()  # all or nothing: no file was written

    code, out, err = export(capsys, "grafana", str(tmp_path), "--force")
    assert code == 0 and not err and len(out) == len(artifacts.FILES["grafana"]) + 1
    assert mine.read_bytes() == (ROOT / "grafana" / "provisioning" / "datasources" / "gpumemd.yaml").read_bytes()
    left = sorted(p.name for p in tmp_path.rglob("*") if p.is_file())
    assert left == ["gpumemd.json", "gpumemd.yaml", "gpumemd.yaml"]  # no temp files left behind


def test_missing_artefacts_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "gpumemd").mkdir()  # neither a wheel's _artifacts/ nor a checkout's exporters/ and grafana/
    monkeypatch.setattr(artifacts, "__file__", str(tmp_path / "gpumemd" / "artifacts.py"))
    code, out, err = export(capsys, "all", str(tmp_path / "out"))
    assert code == 2 and out == [] and len(err) == 1 and "reinstall gpumemd" in err[0], err
    assert not (tmp_path / "out").exists()


def test_the_wheel_carries_the_artefacts_and_finds_them_inside_itself(tmp_path: Path) -> None:
    import setuptools  # the `test` extra installs >= 77, so the wheel builds offline (--no-build-isolation)

    major = int(setuptools.__version__.split(".")[0])
    assert major >= 77, f"setuptools {setuptools.__version__} is too old: pip install -e '.[test]'"
    src = tmp_path / "src"  # a copy: building in the shared checkout would leave build/ behind
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info", "build", "_artifacts")
    src.mkdir()
    for name in ("pyproject.toml", "setup.py", "MANIFEST.in", "LICENSE", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    for name in ("gpumemd", "exporters", "grafana"):
        shutil.copytree(ROOT / name, src / name, ignore=ignore)
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
         "-w", str(tmp_path / "dist"), str(src)],
        capture_output=True, timeout=120,
    )
    assert build.returncode == 0, build.stdout.decode() + build.stderr.decode()
    [wheel] = (tmp_path / "dist").glob("gpumemd-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        zf.extractall(tmp_path / "site")
    for path in artifacts.source_paths():
        assert f"gpumemd/_artifacts/{path}" in names, path
    assert "gpumemd/cli/export.py" in names
    assert all(n.startswith("gpumemd/") or n.split("/")[0].endswith(".dist-info") for n in names), names
    [license_file] = [n for n in names if n.endswith(".dist-info/licenses/LICENSE")]
    assert (tmp_path / "site" / license_file).read_bytes() == (ROOT / "LICENSE").read_bytes()
    [metadata] = [n for n in names if n.endswith(".dist-info/METADATA")]
    assert "License-Expression: Apache-2.0" in (tmp_path / "site" / metadata).read_text()

    # The unpacked wheel, not the checkout: run from tmp_path with only it on the path.
    code = ("import gpumemd.artifacts as a, sys; print(a.find_root('grafana')); print(a.find_root('prometheus'));"
            "from gpumemd.cli import main; sys.exit(main(['export', 'all', sys.argv[1]]))")
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "site")}
    run = subprocess.run([sys.executable, "-c", code, str(tmp_path / "out")], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr
    packaged = str(tmp_path / "site" / "gpumemd" / "_artifacts")
    assert run.stdout.splitlines()[:2] == [packaged, packaged]
    for kind in artifacts.KINDS:
        for a in artifacts.FILES[kind]:
            assert (tmp_path / "out" / kind / a.target).read_bytes() == (ROOT / a.source).read_bytes()
