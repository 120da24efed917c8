"""Read report directories back (``gpumemd report``), refusing anything that is not ours.

Every failure is a ``ReportLoadError`` with a one-line message naming the file and what is wrong.
Snapshots are loaded only through the restricted unpickler (``gpumemd.probes.snapshots.snapshot_load``).
"""

from __future__ import annotations

import json
import os
from typing import Any

from gpumemd.report.build import REPORT_KIND, SCHEMA_VERSION
from gpumemd.report.schema import schema_errors
from gpumemd.report.writer import TEMP_PREFIX

REPORT_FILE = "report.json"
SNAPSHOT_FILE = "snapshot.pickle"
MAX_REPORT_BYTES = 64 * 2**20  # the writer's reports are tens of KiB


class ReportLoadError(ValueError):
    """A missing, truncated or foreign report."""


def is_report_dir(path: str) -> bool:
    return os.path.isfile(os.path.join(path, REPORT_FILE))


def load_report(directory: str) -> dict[str, Any]:
    """``directory/report.json``, checked to be a gpumemd OOM report this version can read."""
    path = os.path.join(directory, REPORT_FILE)
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read(MAX_REPORT_BYTES + 1)
    except FileNotFoundError:
        raise ReportLoadError(f"{path} does not exist: not a gpumemd report directory") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ReportLoadError(f"cannot read {path}: {exc}") from None
    if len(text) > MAX_REPORT_BYTES:
        raise ReportLoadError(f"{path} is larger than {MAX_REPORT_BYTES // 2**20} MiB: not a report gpumemd wrote")
    try:
        report = json.loads(text, parse_int=_parse_int)
    except json.JSONDecodeError as exc:
        raise ReportLoadError(f"{path} is truncated or not JSON ({exc.msg} at line {exc.lineno})") from None
    except RecursionError:
        raise ReportLoadError(f"{path} is nested too deeply: not a report gpumemd wrote") from None
    if not isinstance(report, dict) or report.get("kind") != REPORT_KIND:
        raise ReportLoadError(f"{path} is not a gpumemd OOM report (no kind={REPORT_KIND!r})")
    version = report.get("schema_version")
    if not isinstance(version, int) or isinstance(version, bool) or not 1 <= version <= SCHEMA_VERSION:
        raise ReportLoadError(
            f"{path} has schema_version {version!r}; this gpumemd reads up to {SCHEMA_VERSION}: upgrade gpumemd"
        )
    if not isinstance(report.get("breakdown"), dict):
        raise ReportLoadError(f"{path} has no breakdown section: truncated or edited by hand")
    error = schema_errors(report)
    if error is not None:
        raise ReportLoadError(f"{path} is malformed: {error}")
    if "step_profile" not in report and "phases" in report:
        report["step_profile"] = report.pop("phases")  # written before the section was renamed
    report["_dir"] = directory
    return report


class _LongInt(float):
    """An integer of more digits than a report ever writes, kept as a number the schema refuses by field
    (``int()`` of a 5,000-digit string raises a ValueError that names neither the file nor the field)."""

    digits = 0

    def __repr__(self) -> str:
        return f"a {self.digits}-digit integer"


_MAX_DIGITS = 40  # 2**64 has 20 digits


def _parse_int(text: str) -> int | float:
    if len(text) <= _MAX_DIGITS:
        return int(text)
    value = _LongInt("-inf" if text.startswith("-") else "inf")
    value.digits = len(text.lstrip("-"))
    return value


def find_report_dirs(root: str) -> list[str]:
    """Report directories at or under ``root``, two levels down at most (an output dir holding every
    rank's, or a folder of output dirs), sorted."""
    if is_report_dir(root):
        return [root]
    found: list[str] = []
    for child in _subdirs(root):
        found += [child] if is_report_dir(child) else [d for d in _subdirs(child) if is_report_dir(d)]
    return sorted(found)


def _subdirs(path: str) -> list[str]:
    """The directories in ``path``, links and a writer's temp directories left out ([] when unreadable)."""
    try:
        entries = list(os.scandir(path))
    except OSError:
        return []
    return [e.path for e in entries if e.is_dir(follow_symlinks=False) and not e.name.startswith(TEMP_PREFIX)]
