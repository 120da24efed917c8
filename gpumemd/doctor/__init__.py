"""``gpumemd doctor``'s checks: what will work on this machine and what will not, before a job runs.

Each check is a function of its seams (the torch module or a fake with the same attributes, the NVML
binding or a fake, the pid, the environment, paths), so the CUDA, NVML and container cases are tested
on a CPU machine. ``run_checks`` composes them with the real modules; a check that raises unexpectedly
becomes a "warn" line, never a crash: doctor is what people run when something is already odd.

Unlike the agent's probes, doctor may initialise CUDA and create a context: it runs in its own process,
and NVML lists a process only once it has a context.
"""

from __future__ import annotations

import os
import platform
from collections.abc import Callable, Mapping
from typing import Any

from gpumemd._version import __version__
from gpumemd.doctor.allocator_checks import check_allocator, check_history
from gpumemd.doctor.check import Check
from gpumemd.doctor.config_checks import INVALID, check_config, resolve_field
from gpumemd.doctor.fork_checks import check_device_count
from gpumemd.doctor.host_checks import (
    check_frameworks,
    check_memory_limits,
    check_output_dir,
    check_port,
    check_prometheus,
    check_psutil,
)
from gpumemd.doctor.nvml_checks import check_nvml, import_nvml
from gpumemd.doctor.torch_checks import check_cuda, check_numpy, check_torch, cuda_context, cuda_ready, import_torch
from gpumemd.probes.process.identity import identity_from_env


def guarded(name: str, needed: bool, fn: Callable[..., Check | list[Check]], *args: Any, **kw: Any) -> list[Check]:
    """Run one check; an unexpected exception is a warning line naming it, never a crash."""
    try:
        result = fn(*args, **kw)
    except Exception as exc:  # noqa: BLE001 - doctor must answer on every machine, however odd
        return [Check(name, "warn", f"the check itself failed ({type(exc).__name__}: {exc})", needed)]
    return [result] if isinstance(result, Check) else list(result)


def run_checks(environ: Mapping[str, str] | None = None, overrides: Mapping[str, str] | None = None,
               *, pid: int | None = None) -> list[Check]:
    """Every check, with the real modules. ``overrides``: Config fields as command-line text."""
    env = os.environ if environ is None else environ
    given = dict(overrides or {})
    checks = [Check("gpumemd", "ok", f"{__version__} on Python {platform.python_version()} ({platform.platform()})")]
    checks += guarded("config", True, check_config, env, given)
    imported = import_torch()
    torch = imported.module
    checks += guarded("torch", True, check_torch, torch, imported.error)
    checks += guarded("numpy", False, check_numpy, imported.numpy_warning)
    checks += guarded("cuda", False, check_cuda, torch, env)
    checks += guarded("device count", False, check_device_count, torch, env)
    checks += guarded("allocator", False, check_allocator, torch, env)
    checks += guarded("allocation history", False, check_history, torch)
    checks += _nvml_checks(torch, env, os.getpid() if pid is None else pid)
    checks += guarded("psutil", True, check_psutil)
    checks += guarded("memory limits", False, check_memory_limits)
    values = {n: resolve_field(n, env, given) for n in ("output_dir", "port", "bind", "textfile", "pushgateway")}
    exporting = any(values[n] not in (None, INVALID) for n in ("port", "textfile", "pushgateway"))
    checks += guarded("prometheus_client", exporting, check_prometheus, exporting)
    checks += _config_dependent(values, env)
    checks += guarded("frameworks", False, check_frameworks)
    return checks


def _nvml_checks(torch: Any, env: Mapping[str, str], pid: int) -> list[Check]:
    """NVML after a CUDA context exists (when there is CUDA), so it can be asked about this pid."""
    try:
        sees_cuda = cuda_ready(torch)
    except Exception:  # noqa: BLE001 - check_cuda has already said what is wrong
        sees_cuda = False
    context, context_error = cuda_context(torch) if sees_cuda else (None, None)
    try:
        return guarded("nvml", False, check_nvml, import_nvml(), pid, visible=env.get("CUDA_VISIBLE_DEVICES"),
                       torch_sees_cuda=sees_cuda, has_context=context is not None, context_error=context_error)
    finally:
        del context


def _config_dependent(values: dict[str, Any], env: Mapping[str, str]) -> list[Check]:
    """Output directory and port; each skipped ("n/a") when its own configured value is invalid."""
    invalid = "not checked: its configured value is not valid (see config)"
    out = [Check("output dir", "n/a", invalid)] if values["output_dir"] is INVALID \
        else guarded("output dir", True, check_output_dir, values["output_dir"])
    if values["port"] is INVALID or values["bind"] is INVALID:
        out.append(Check("metrics port", "n/a", invalid))
    else:
        identity = identity_from_env(env)
        local_rank = identity.local_rank if identity is not None else 0
        out += guarded("metrics port", values["port"] is not None, check_port, values["bind"], values["port"],
                       local_rank)
    return out
