"""The host around the job: psutil, prometheus_client, the output directory, the metrics port and
the installed training frameworks."""

from __future__ import annotations

import errno
import ipaddress
import os
import shutil
import socket

from gpumemd.analysis.units import format_bytes
from gpumemd.doctor.check import Check, dist_version
from gpumemd.output_dir import nearest_existing, output_dir_problem

_LOW_DISK_BYTES = 1 << 30  # an OOM report with an allocator snapshot can be hundreds of MiB
_FRAMEWORKS = {  # distribution -> what gpumemd offers for it (never needed: gpumemd works without any)
    "lightning": "gpumemd.integrations.lightning.GpumemdCallback",
    "pytorch-lightning": "gpumemd.integrations.lightning.GpumemdCallback",
    "transformers": "gpumemd.integrations.transformers.GpumemdCallback",
    "accelerate": "transformers' Trainer needs it",
}


def check_psutil() -> Check:
    """The agent's host probe needs psutil: attach fails without it."""
    try:
        import psutil
    except ImportError as exc:
        return Check("psutil", "fail", f"not importable ({exc}): pip install psutil", needed=True)
    rss = psutil.Process().memory_info().rss
    vm = psutil.virtual_memory()
    return Check("psutil", "ok", f"{psutil.__version__}: this process {format_bytes(rss)} RSS; host "
                 f"{format_bytes(vm.available)} available of {format_bytes(vm.total)}", needed=True)


def check_memory_limits(root: str = "/") -> Check:
    """The memory limits this process runs under (host RAM, cgroup, rlimits) and which one binds: the
    agent's host headroom and its OOM projections are measured against that one."""
    from gpumemd.probes.process.host import HostProbe

    probe = HostProbe(pinned_fn=lambda: None, root=root)
    try:
        limits = probe.limits()
    finally:
        probe.close()
    if not limits:
        return Check("memory limits", "warn", "none could be read: host headroom is unknown")
    bound = min(limits, key=lambda limit: limit.headroom_bytes)
    where = f" ({probe.cgroup.binding_file})" if bound.kind == "cgroup" and probe.cgroup.binding_file else ""
    others = [f"{limit.words} {format_bytes(limit.headroom_bytes)} left of {format_bytes(limit.limit_bytes)}"
              for limit in limits if limit is not bound]
    if probe.cgroup.version is not None and not any(limit.kind == "cgroup" for limit in limits):
        others.append(f"cgroup v{probe.cgroup.version} {probe.cgroup.path}: no memory limit")
    detail = (f"bound by {bound.words}{where}: {format_bytes(bound.headroom_bytes)} left of "
              f"{format_bytes(bound.limit_bytes)}" + ("; " + "; ".join(others) if others else ""))
    return Check("memory limits", "ok", detail)


def check_prometheus(wanted: bool) -> Check:
    """prometheus_client serves, pushes and writes metrics; needed only when one of those is configured."""
    version = dist_version("prometheus-client") or dist_version("prometheus_client")
    if version is not None:
        return Check("prometheus_client", "ok", version, needed=wanted)
    if wanted:
        return Check("prometheus_client", "fail", "not installed, and a metrics port, textfile or pushgateway is "
                     "configured: pip install prometheus-client", needed=True)
    return Check("prometheus_client", "warn", "not installed: no metrics server, textfile or push "
                 "(pip install prometheus-client)")


def check_output_dir(path: str) -> Check:
    """Writable: a temp file is created (and removed) in it, or, when it does not exist yet, in its
    nearest existing parent, where the agent would create it (``gpumemd.output_dir``, the check the
    agent makes at start). Doctor never creates the directory."""
    name = "output dir"
    target = os.path.abspath(path)
    problem = output_dir_problem(target)
    if problem is not None:
        return Check(name, "fail", f"{problem}; the agent would write to a temporary directory instead "
                     "(its start line names it): set GPUMEMD_OUTPUT_DIR or output_dir= to a writable one",
                     needed=True)
    base = nearest_existing(target)
    free = shutil.disk_usage(base).free
    where = f"{target} is writable" if base == target else \
        f"{target} does not exist yet and will be created on first write ({base} is writable)"
    if free < _LOW_DISK_BYTES:
        return Check(name, "warn", f"{where}, but only {format_bytes(free)} free: OOM reports with allocator "
                     "snapshots may not fit", needed=True)
    return Check(name, "ok", f"{where}; {format_bytes(free)} free", needed=True)


def check_port(bind: str, port: int | None, local_rank: int = 0) -> Check:
    """Bind and close as the metrics server would (SO_REUSEADDR, then listen), at port + LOCAL_RANK."""
    name = "metrics port"
    if port is None:
        return Check(name, "n/a", "no metrics port configured (--port / GPUMEMD_PORT): no server is started")
    final = port + local_rank if port else 0
    rank_note = f" (port {port} + LOCAL_RANK {local_rank})" if port and local_rank else ""
    if final > 65535:
        return Check(name, "fail", f"port {final}{rank_note} is above 65535", needed=True)
    family = socket.AF_INET6 if ipaddress.ip_address(bind).version == 6 else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server: TIME_WAIT is no conflict
        sock.bind((bind, final))
        sock.listen(1)
        got = int(sock.getsockname()[1])
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            why = "is already in use: the job would run without a metrics endpoint (choose another --port / " \
                  "GPUMEMD_PORT, or 0 for any free port)"
        else:
            why = f"could not be bound ({exc.strerror or exc})"
        return Check(name, "fail", f"{bind}:{final}{rank_note} {why}", needed=True)
    finally:
        sock.close()
    if final == 0:
        return Check(name, "ok", f"port 0: a free port is picked at attach ({bind}:{got} was free now)", needed=True)
    return Check(name, "ok", f"{bind}:{final}{rank_note} is free", needed=True)


def check_frameworks() -> list[Check]:
    """Installed training frameworks, from package metadata (never imported: that takes seconds)."""
    versions = {dist: dist_version(dist) for dist in _FRAMEWORKS}
    return [Check(dist, "ok", f"{version}: {_FRAMEWORKS[dist]}") if version else Check(dist, "n/a", "not installed")
            for dist, version in versions.items()]
