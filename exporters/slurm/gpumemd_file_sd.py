#!/usr/bin/env python3
"""Write a Prometheus file_sd target file for every rank of a Slurm job (stdlib only).

Each rank of a job run with ``srun gpumemd run train.py`` (or ``srun torchrun ... gpumemd run``)
serves ``/metrics`` on ``GPUMEMD_PORT + LOCAL_RANK`` on its node, so the targets of a job are
``node:port .. node:port+tasks_on_node-1`` for every node of the allocation. This script expands
the allocation's node list (``scontrol show hostnames`` when available, else a built-in expander
of Slurm's hostlist syntax such as ``gpu[01-04,07],login1``) and the per-node task counts
(``SLURM_TASKS_PER_NODE``, e.g. ``4(x2),2``), and writes the file atomically (temp + rename) so
Prometheus never reads half a file. Use it in the batch script, next to the Prometheus file_sd
directory that ``exporters/prometheus/prometheus-file-sd.yml`` watches::

    export GPUMEMD_PORT=9400 GPUMEMD_BIND=0.0.0.0
    SD=/shared/prometheus/file_sd/gpumemd-$SLURM_JOB_ID.json
    python exporters/slurm/gpumemd_file_sd.py --port $GPUMEMD_PORT --output "$SD"
    trap 'python exporters/slurm/gpumemd_file_sd.py --output "$SD" --remove' EXIT
    srun --ntasks-per-node 4 gpumemd run train.py

Everything read from the environment can be given explicitly (``--nodelist``, ``--tasks-per-node``,
``--job-name``), which also makes it usable for torchrun jobs on hand-picked nodes.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence

_MAX_HOSTS = 100_000  # a typo such as node[1-99999999] must not eat the login node's memory


def split_top_level(text: str) -> list[str]:
    """``"a[1-2],b"`` -> ``["a[1-2]", "b"]``: commas inside brackets do not split."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"hostlist {text!r}: unbalanced ']' at position {i}")
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth != 0:
        raise ValueError(f"hostlist {text!r}: unbalanced '['")
    parts.append(text[start:])
    return [p for p in (p.strip() for p in parts) if p]


def _expand_range(spec: str, whole: str) -> list[str]:
    out: list[str] = []
    for item in spec.split(","):
        lo, sep, hi = item.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"hostlist {whole!r}: {item!r} is not a number or a range like 01-04")
        if not sep:
            out.append(lo)
            continue
        width = len(lo)  # Slurm keeps the zero padding of the lower bound: 01-10 -> 01 .. 10
        first, last = int(lo), int(hi)
        if last < first:
            raise ValueError(f"hostlist {whole!r}: range {item!r} runs backwards")
        if last - first >= _MAX_HOSTS:
            raise ValueError(f"hostlist {whole!r}: range {item!r} has more than {_MAX_HOSTS} hosts")
        out.extend(str(n).zfill(width) for n in range(first, last + 1))
    return out


def expand_hostlist(text: str) -> list[str]:
    """Slurm's compressed hostlist to host names, in order (``rack[1-2]-n[1-2]`` is a product)."""
    hosts: list[str] = []
    for part in split_top_level(text):
        names = [""]
        for literal, bracket in re.findall(r"([^\[]*)(?:\[([^\]]*)\])?", part):
            if not literal and not bracket:
                continue
            choices = _expand_range(bracket, text) if bracket else [""]
            names = [n + literal + c for n in names for c in choices]
            if len(names) > _MAX_HOSTS:
                raise ValueError(f"hostlist {text!r} has more than {_MAX_HOSTS} hosts")
        hosts.extend(names)
    return hosts


def expand_tasks_per_node(text: str, nodes: int) -> list[int]:
    """``SLURM_TASKS_PER_NODE`` (``"4(x2),2"``) or one number for every node, to one count per node."""
    counts: list[int] = []
    for item in text.split(","):
        match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", item)
        if not match:
            raise ValueError(f"tasks per node {text!r}: {item!r} is not N or N(xM)")
        counts.extend([int(match.group(1))] * int(match.group(2) or 1))
    if len(counts) == 1 and nodes > 1:
        counts *= nodes
    if len(counts) != nodes:
        raise ValueError(f"tasks per node {text!r} gives {len(counts)} counts for {nodes} nodes")
    return counts


def targets(hosts: Sequence[str], tasks: Sequence[int], port: int,
            labels: Mapping[str, str]) -> list[dict[str, object]]:
    """One file_sd group per node: ``host:port+local_rank`` for each of its tasks."""
    if not 1 <= port <= 65535:
        raise ValueError(f"--port {port} is not valid: expected 1-65535 (GPUMEMD_PORT of the job)")
    if len(hosts) != len(tasks):
        raise ValueError(f"{len(hosts)} hosts but {len(tasks)} task counts")
    groups: list[dict[str, object]] = []
    for host, count in zip(hosts, tasks, strict=True):
        if port + count - 1 > 65535:
            raise ValueError(f"--port {port} + {count} tasks on {host} runs past port 65535")
        groups.append({
            "targets": [f"{host}:{port + local}" for local in range(count)],
            "labels": {**labels, "node": host},
        })
    return groups


def hostnames(nodelist: str) -> list[str]:
    """``scontrol show hostnames`` when Slurm is installed (authoritative), else the built-in expander."""
    scontrol = shutil.which("scontrol")
    if scontrol:
        done = subprocess.run([scontrol, "show", "hostnames", nodelist], capture_output=True, text=True,
                              timeout=30, check=False)
        if done.returncode == 0 and done.stdout.split():
            return done.stdout.split()
    return expand_hostlist(nodelist)


def write_atomically(path: str, text: str) -> None:
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".gpumemd-sd-", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def main(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> int:
    env = os.environ if env is None else env
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodelist", default=env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST"),
                   help="Slurm hostlist (default: $SLURM_JOB_NODELIST)")
    p.add_argument("--tasks-per-node", default=env.get("SLURM_TASKS_PER_NODE") or env.get("SLURM_NTASKS_PER_NODE"),
                   help="tasks (ranks) per node, N or Slurm's N(xM),... (default: $SLURM_TASKS_PER_NODE, else 1)")
    p.add_argument("--port", type=int, default=int(env.get("GPUMEMD_PORT", "9400") or 9400),
                   help="the job's GPUMEMD_PORT; local rank r serves port+r (default: $GPUMEMD_PORT or 9400)")
    p.add_argument("--job-name", default=env.get("SLURM_JOB_NAME"),
                   help="value of the training_job label (default: $SLURM_JOB_NAME)")
    p.add_argument("--output", help="file to write (atomically); default: standard output")
    p.add_argument("--remove", action="store_true", help="delete --output (at the end of the job)")
    args = p.parse_args(argv)
    try:
        if args.remove:
            if not args.output:
                raise ValueError("--remove needs --output")
            if os.path.exists(args.output):
                os.unlink(args.output)
            return 0
        if not args.nodelist:
            raise ValueError("no node list: run inside a Slurm job or pass --nodelist 'node[01-04]'")
        hosts = hostnames(args.nodelist)
        tasks = expand_tasks_per_node(args.tasks_per_node or "1", len(hosts))
        labels = {k: v for k, v in {
            "training_job": args.job_name or "",
            "slurm_job_id": env.get("SLURM_JOB_ID", ""),
        }.items() if v}
        text = json.dumps(targets(hosts, tasks, args.port, labels), indent=2) + "\n"
    except (ValueError, OSError, subprocess.SubprocessError) as err:
        print(f"gpumemd_file_sd: {err}", file=sys.stderr)
        return 2
    if args.output:
        write_atomically(args.output, text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
