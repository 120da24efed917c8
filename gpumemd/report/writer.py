"""Write one report directory atomically: a hidden temp directory, then one ``os.rename``.

Readers (and ``gpumemd report``) see either no directory or a complete one. A write that fails
halfway (disk full, quota) removes its temp directory and leaves nothing behind.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import pickle
import shutil
import tempfile
from collections.abc import Mapping
from typing import Any

TEMP_PREFIX = ".gpumemd-tmp-"


def report_dir_name(rank: int, step: int | None, wall_time: float) -> str:
    """``oom-rank0-step000120-20261121T225512.345Z``: sorts by rank, then step, then time."""
    stamp = _dt.datetime.fromtimestamp(wall_time, tz=_dt.timezone.utc)
    when = stamp.strftime("%Y%m%dT%H%M%S") + f".{stamp.microsecond // 1000:03d}Z"
    step_part = f"step{step:06d}" if step is not None else "stepnone"
    return f"oom-rank{rank}-{step_part}-{when}"


def _write_file(path: str, data: bytes) -> None:
    with open(path, "xb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def write_report_dir(parent: str, name: str, files: Mapping[str, bytes]) -> str:
    """Write ``files`` (name -> bytes) into ``parent/name`` atomically; returns the final path.

    If ``parent/name`` exists (two OOMs in one millisecond), ``-2``, ``-3``... is appended.
    """
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=TEMP_PREFIX, dir=parent)
    try:
        for filename, data in files.items():
            _write_file(os.path.join(tmp, filename), data)
        final = os.path.join(parent, name)
        for n in range(2, 1000):
            try:
                os.rename(tmp, final)  # atomic on one filesystem; fails if final exists and is not empty
            except OSError:
                if not os.path.exists(final):
                    raise
                final = os.path.join(parent, f"{name}-{n}")
                continue
            return final
        raise FileExistsError(f"{os.path.join(parent, name)} and 998 suffixed variants already exist")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def render_files(report: dict[str, Any], snapshot: dict[str, Any] | None) -> dict[str, bytes]:
    """File name -> content of one report directory."""
    from gpumemd.report.html import render_html
    from gpumemd.report.markdown import render_markdown

    files = {
        "report.json": json.dumps(report, indent=1, allow_nan=False).encode(),
        "report.md": render_markdown(report).encode(),
        "report.html": render_html(report).encode(),
    }
    if snapshot is not None:
        files["snapshot.pickle"] = pickle.dumps(snapshot)  # what torch.cuda.memory._dump_snapshot writes
    return files
