"""Where the shipped Grafana dashboard and Prometheus rules/configs are: in the wheel, or in the checkout.

The files live once, at the repository root (``grafana/``, ``exporters/``). A wheel carries copies at
``gpumemd/_artifacts/<the same relative path>``, put there by ``setup.py`` at build time from
:data:`FILES`; an editable install (and a plain source checkout) reads them where they are. The packaged
copy wins when both exist.

Stdlib only, and nothing from ``gpumemd``: ``setup.py`` loads this file by path to learn what to copy.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

if sys.version_info >= (3, 11):
    from importlib.resources.abc import Traversable
else:
    from importlib.abc import Traversable

PACKAGED_DIR = "_artifacts"  # inside the ``gpumemd`` package of a wheel


@dataclass(frozen=True)
class Artifact:
    source: str  # relative to the repository root, and to gpumemd/_artifacts/ in a wheel
    target: str  # relative to the directory ``gpumemd export`` writes into
    executable: bool = False


FILES: dict[str, tuple[Artifact, ...]] = {
    "grafana": (
        Artifact("grafana/dashboards/gpumemd.json", "dashboards/gpumemd.json"),
        Artifact("grafana/provisioning/dashboards/gpumemd.yaml", "provisioning/dashboards/gpumemd.yaml"),
        Artifact("grafana/provisioning/datasources/gpumemd.yaml", "provisioning/datasources/gpumemd.yaml"),
    ),
    "prometheus": (
        Artifact("exporters/prometheus/rules/gpumemd.rules.yml", "rules/gpumemd.rules.yml"),
        Artifact("exporters/prometheus/rules/gpumemd.rules.test.yml", "rules/gpumemd.rules.test.yml"),
        Artifact("exporters/prometheus/rules/gpumemd.rules.runs.test.yml", "rules/gpumemd.rules.runs.test.yml"),
        Artifact("exporters/prometheus/prometheus.yml", "prometheus.yml"),
        Artifact("exporters/prometheus/prometheus-file-sd.yml", "prometheus-file-sd.yml"),
        Artifact("exporters/prometheus/file_sd/gpumemd-example-job.json", "file_sd/gpumemd-example-job.json"),
        Artifact("exporters/prometheus/file_sd/write_targets.sh", "file_sd/write_targets.sh", executable=True),
        Artifact("exporters/prometheus/kubernetes/podmonitor.yaml", "kubernetes/podmonitor.yaml"),
        Artifact("exporters/slurm/gpumemd_file_sd.py", "slurm/gpumemd_file_sd.py", executable=True),
    ),
}
KINDS = tuple(FILES)


class ArtifactsNotFound(FileNotFoundError):
    """Neither the installed package nor a source checkout holds the files (a broken install)."""


def source_paths() -> list[str]:
    """Every file to ship, relative to the repository root (what ``setup.py`` copies into the wheel)."""
    return [a.source for kind in KINDS for a in FILES[kind]]


def _at(root: Traversable, relative: str) -> Traversable:
    for part in relative.split("/"):  # one part at a time: Python 3.10's Traversable.joinpath takes one
        root = root / part
    return root


def _complete(root: Traversable, kind: str) -> bool:
    return all(_at(root, a.source).is_file() for a in FILES[kind])


def find_root(kind: str) -> Traversable:
    """The directory the :data:`FILES` of ``kind`` are relative to: the packaged copy, else the checkout."""
    if kind not in FILES:
        raise ValueError(f"unknown artefact kind {kind!r} (one of: {', '.join(KINDS)})")
    packaged = resources.files(__package__ or "gpumemd").joinpath(PACKAGED_DIR)
    if _complete(packaged, kind):
        return packaged
    checkout = Path(__file__).resolve().parent.parent
    if _complete(checkout, kind):
        return checkout
    raise ArtifactsNotFound(
        f"the {kind} files are not installed (no {PACKAGED_DIR}/ in the gpumemd package) and {checkout} is not a "
        "gpumemd source checkout; reinstall gpumemd (pip install --force-reinstall --no-deps gpumemd)"
    )


def read(kind: str) -> list[tuple[Artifact, bytes]]:
    """Every file of ``kind`` with its bytes, in :data:`FILES` order."""
    root = find_root(kind)
    return [(a, _at(root, a.source).read_bytes()) for a in FILES[kind]]
