"""``gpumemd doctor``'s checks: what will work on this machine and what will not, before a job runs.

Each check is a function of its seams (the torch module or a fake with the same attributes, the NVML
binding or a fake, the pid, the environment, paths), so the CUDA, NVML and container cases are tested
on a CPU machine. ``run_checks`` composes them with the real modules; a check that raises unexpectedly
becomes a "warn" line, never a crash: doctor is what people run when something is already odd.

Unlike the agent's probes, doctor may initialise CUDA and create a context: it runs in its own process,
and NVML lists a process only once it has a context.
"""

from __future__ import annotations

import contextlib
import errno
import importlib.metadata
import ipaddress
import os
import platform
import re
import shutil
import socket
import tempfile
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from gpumemd._version import __version__
from gpumemd.analysis.units import format_bytes
from gpumemd.config import ENV_PREFIX, Config, ConfigError, field_types, is_optional, parse_value, unknown_env_lines
from gpumemd.probes.identity import identity_from_env
from gpumemd.probes.nvml import visible_indices

Status = Literal["ok", "warn", "fail", "n/a"]

MIN_TORCH = (2, 1)  # pyproject's torch>=2.1: older builds lack the history and snapshot APIs we read
_LOW_DISK_BYTES = 1 << 30  # an OOM report with an allocator snapshot can be hundreds of MiB
_FRAMEWORKS = {  # distribution -> what gpumemd offers for it (never needed: gpumemd works without any)
    "lightning": "gpumemd.integrations.lightning.GpumemdCallback",
    "pytorch-lightning": "gpumemd.integrations.lightning.GpumemdCallback",
    "transformers": "gpumemd.integrations.transformers.GpumemdCallback",
    "accelerate": "transformers' Trainer needs it",
}


@dataclass(frozen=True)
class Check:
    """One line of the doctor's answer. ``needed``: gpumemd cannot do its core job when this fails."""

    name: str
    status: Status
    detail: str
    needed: bool = False


def failed_needed(checks: list[Check]) -> list[Check]:
    """The checks that make the verdict "no": needed and failed (a warning never does)."""
    return [c for c in checks if c.needed and c.status == "fail"]


# --- gpumemd's own configuration ------------------------------------------------------------------


def _option(name: str) -> str:
    return "--" + name.replace("_", "-")


def _parse_override(name: str, raw: str) -> Any:
    """Command-line text -> a field value, as ``gpumemd run`` parses it ('' unsets an optional field)."""
    if raw.strip() == "" and is_optional(name):
        return None
    try:
        return parse_value(field_types()[name], raw)
    except ConfigError as err:
        raise ConfigError(name, raw, err.accepted) from None


def _known_env(environ: Mapping[str, str]) -> dict[str, str]:
    """Only the ``GPUMEMD_*`` variables that name options: ``Config.from_sources`` would log the
    unknown ones as a warning on stderr, and doctor reports them as lines of its own instead."""
    names = {ENV_PREFIX + name.upper() for name in field_types()}
    return {k: v for k, v in environ.items() if k in names}


def check_config(environ: Mapping[str, str], overrides: Mapping[str, str]) -> list[Check]:
    """The configuration the agent would build from ``GPUMEMD_*`` and the given options (raw text by
    field name); a bad value fails naming its variable or option. Unknown ``GPUMEMD_*`` variables
    are warnings with the closest option (config.py's own wording)."""
    out: list[Check] = []
    parsed: dict[str, Any] = {}
    try:
        for name, raw in overrides.items():
            parsed[name] = _parse_override(name, raw)
        Config.from_sources(_known_env(environ), **parsed)
    except ConfigError as err:
        message = err.render(f"{_option(err.field)}={{value}}") if err.field in overrides else str(err)
        out.append(Check("config", "fail", message, needed=True))
    else:
        given = [f"{k}={v}" for k, v in sorted(_known_env(environ).items())]
        given += [f"{_option(n)}={overrides[n]}" for n in sorted(overrides)]
        out.append(Check("config", "ok", f"valid ({', '.join(given) if given else 'defaults'})", needed=True))
    out.extend(Check("config", "warn", line) for line in unknown_env_lines(environ))
    return out


_INVALID = object()  # a field whose configured value is not valid (check_config says why)


def resolve_field(name: str, environ: Mapping[str, str], overrides: Mapping[str, str]) -> Any:
    """One Config field as the agent would see it, or ``_INVALID``. Field by field, so that a bad
    GPUMEMD_PORT does not stop the output directory from being checked."""
    var = ENV_PREFIX + name.upper()
    env = {var: environ[var]} if var in environ else {}
    try:
        kw = {name: _parse_override(name, overrides[name])} if name in overrides else {}
        return getattr(Config.from_sources(env, **kw), name)
    except ValueError:  # ConfigError
        return _INVALID


# --- torch, numpy, CUDA ---------------------------------------------------------------------------


@dataclass(frozen=True)
class TorchImport:
    module: Any  # None when ``import torch`` failed
    error: str | None
    numpy_warning: str | None  # torch's "Failed to initialize NumPy: ..." UserWarning, if it gave one


def import_torch() -> TorchImport:
    """``import torch`` with its warnings caught: a missing or broken NumPy makes torch warn "Failed to
    initialize NumPy" on import, which belongs on doctor's numpy line, not on stderr before the answer."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            import torch
        except Exception as exc:  # noqa: BLE001 - a broken install raises anything (OSError for a .so)
            return TorchImport(None, f"{type(exc).__name__}: {exc}", _numpy_warning(caught))
    return TorchImport(torch, None, _numpy_warning(caught))


def _numpy_warning(caught: list[warnings.WarningMessage]) -> str | None:
    for w in caught:
        if "numpy" in str(w.message).lower():  # the C++ location torch appends says nothing to a user
            return re.sub(r"\s*\(Triggered internally at [^)]*\)", "", str(w.message)).strip()
    return None


def _version_tuple(text: str) -> tuple[int, int] | None:
    match = re.match(r"(\d+)\.(\d+)", text)
    return (int(match[1]), int(match[2])) if match else None


def _build(torch: Any) -> str:
    version = getattr(torch, "version", None)
    hip, cuda = getattr(version, "hip", None), getattr(version, "cuda", None)
    if hip:
        return f"ROCm {hip} build"
    return f"CUDA {cuda} build" if cuda else "CPU-only build (no CUDA)"


def check_torch(torch: Any, error: str | None = None) -> Check:
    """Importable, and at least the oldest version gpumemd supports."""
    floor = ".".join(map(str, MIN_TORCH))
    if torch is None:
        return Check("torch", "fail", f"cannot import torch ({error}): gpumemd needs PyTorch >= {floor}",
                     needed=True)
    version = str(getattr(torch, "__version__", "?"))
    parsed = _version_tuple(version)
    if parsed is None or parsed < MIN_TORCH:
        return Check("torch", "fail", f"{version} is older than {floor}, the oldest gpumemd supports "
                     "(or its version cannot be read)", needed=True)
    return Check("torch", "ok", f"{version}, {_build(torch)}", needed=True)


def check_numpy(numpy_warning: str | None) -> Check:
    """gpumemd never uses NumPy; torch does for interop, and says so on import when it cannot."""
    if numpy_warning:
        return Check("numpy", "warn", f"torch could not initialise NumPy ({numpy_warning}): tensor.numpy() "
                     "and NumPy interop will fail; gpumemd itself does not use NumPy")
    version = _dist_version("numpy")
    if version is None:
        return Check("numpy", "n/a", "not installed: torch runs without it, and so does gpumemd")
    return Check("numpy", "ok", version)


def cuda_ready(torch: Any) -> bool:
    """torch can use at least one CUDA (or ROCm) device here."""
    if torch is None:
        return False
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # check_cuda reports the CUDA initialisation warning
        return bool(torch.cuda.is_available())


def check_cuda(torch: Any, environ: Mapping[str, str]) -> Check:
    """Device count, names and sizes; why there are none when a CUDA build sees none."""
    if torch is None:
        return Check("cuda", "n/a", "torch is not importable")
    if not torch.backends.cuda.is_built():
        return Check("cuda", "n/a", "CPU-only torch build: no device memory to record; gpumemd records host "
                     "memory, tensors and leaks only")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        available = bool(torch.cuda.is_available())
    if not available:
        why = "; ".join(str(w.message).strip() for w in caught) or "no driver or no device"
        visible = environ.get("CUDA_VISIBLE_DEVICES")
        if visible is not None:
            why += f"; CUDA_VISIBLE_DEVICES={visible!r}"
        return Check("cuda", "warn", f"torch is a {_build(torch)} but sees no device ({why}): gpumemd "
                     "records host memory only")
    count = int(torch.cuda.device_count())
    devices = []
    for i in range(count):
        props = torch.cuda.get_device_properties(i)
        devices.append(f"{i} {props.name} ({format_bytes(int(props.total_memory))})")
    return Check("cuda", "ok", f"{count} device{'s' if count != 1 else ''}: {', '.join(devices)}")


# --- the CUDA caching allocator -------------------------------------------------------------------

_CONF_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF", "PYTORCH_ALLOC_CONF")


def parse_alloc_conf(text: str) -> dict[str, str]:
    """``key:value,key:[a,b]`` -> {key: value}; commas inside brackets belong to the value."""
    items, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    items.append(text[start:])
    out: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition(":")
        if sep and key.strip():
            out[key.strip()] = value.strip()
    return out


def alloc_conf(environ: Mapping[str, str]) -> tuple[str | None, dict[str, str], str | None]:
    """(the variable read, its settings, a note when several are set and disagree). torch 2.13's CUDA
    config reads PYTORCH_CUDA_ALLOC_CONF first while its generic config calls PYTORCH_ALLOC_CONF the
    primary one, so two differing variables are a hazard worth a line, not a precedence to guess."""
    present = [(var, environ[var]) for var in _CONF_VARS if environ.get(var, "").strip()]
    if not present:
        return None, {}, None
    var, text = present[0]
    note = None
    if len({frozenset(parse_alloc_conf(t).items()) for _, t in present}) > 1:
        note = f"{' and '.join(v for v, _ in present)} are set and differ; which one torch reads depends on " \
               "its version: set one"
    return var, parse_alloc_conf(text), note


def check_allocator(torch: Any, environ: Mapping[str, str]) -> list[Check]:
    """The backend (what gpumemd can read from it) and expandable segments (what its numbers mean)."""
    var, conf, note = alloc_conf(environ)
    source = f" ({var})" if var else ""
    if not cuda_ready(torch):
        why = "no CUDA device" + (f": {var}={environ[var]!r} has no effect" if var else "")
        return [Check("allocator", "n/a", why), Check("expandable segments", "n/a", "no CUDA device")]
    backend = str(torch.cuda.memory.get_allocator_backend())
    if backend == "native":
        status: Status = "ok"
        detail = f"native caching allocator{source}: every statistic, snapshots, allocation history and the " \
                 "OOM observer are available"
    elif backend == "cudaMallocAsync":
        status = "warn"
        detail = f"cudaMallocAsync{source}: only allocated, active and reserved bytes (current and peak) are " \
                 "counted; fragmentation, segment, retry and OOM counters read 0; no snapshots, allocation " \
                 "history or OOM observer, so OOM reports carry no allocator snapshot or allocation sites"
    else:
        status, detail = "warn", f"{backend}{source}: an allocator gpumemd does not know; statistics may be absent"
    if environ.get("PYTORCH_NO_CUDA_MEMORY_CACHING", "").strip() not in ("", "0"):
        status = "warn"
        detail += "; PYTORCH_NO_CUDA_MEMORY_CACHING is set: nothing is cached, reserved equals allocated"
    if note:
        status, detail = "warn", f"{detail}; {note}"
    return [Check("allocator", status, detail), _expandable(conf.get("expandable_segments"), backend, source)]


def _expandable(value: str | None, backend: str, source: str) -> Check:
    name = "expandable segments"
    if backend != "native":
        return Check(name, "n/a", f"applies to the native allocator only, not {backend}")
    if value is None or value.lower() == "false":
        return Check(name, "ok", "off (the default): memory reserved but unallocated can be fragmentation; an "
                     "OOM report says so and suggests expandable_segments:True when it is")
    if value.lower() != "true":
        return Check(name, "warn", f"expandable_segments:{value}{source} is neither True nor False")
    return Check(name, "ok", f"on{source}: segments grow in place, so reserved-but-unallocated memory stays "
                 "small and is rarely fragmentation; torch does not count their blocks in inactive_split_bytes, "
                 "so gpumemd reports no fragmentation figure or finding; snapshots show is_expandable segments "
                 "and the device alloc/free counts are page mappings, not cudaMalloc calls")


def check_history(torch: Any) -> Check:
    """Whether allocation history is already being recorded in this process (cost, and stacks)."""
    is_enabled = getattr(getattr(torch, "_C", None), "_cuda_isHistoryEnabled", None)
    if is_enabled is None:
        return Check("allocation history", "n/a", "this torch build has no CUDA allocation history")
    if not cuda_ready(torch):
        return Check("allocation history", "n/a", "no CUDA device")
    if is_enabled():
        return Check("allocation history", "ok", "already on in this process: snapshots and OOM reports name "
                     "allocation sites (about 2 µs per allocation)")
    return Check("allocation history", "ok", "off (the default); GPUMEMD_RECORD_HISTORY=1 records stacks from the "
                 "start (about 2 µs per allocation), GPUMEMD_LEAK_HISTORY_ON_SUSPECT=1 once a leak is suspected")


def cuda_context(torch: Any) -> tuple[Any, str | None]:
    """A 1-element tensor on the current device, so this process has a CUDA context NVML can list.
    Returns (the tensor, to keep alive while NVML looks; None and why when it cannot be made)."""
    try:
        return torch.ones(1, device="cuda"), None
    except Exception as exc:  # noqa: BLE001 - any CUDA error here is itself the answer
        return None, f"{type(exc).__name__}: {exc}"


# --- NVML -----------------------------------------------------------------------------------------


def import_nvml() -> Any:
    """The NVML binding (nvidia-ml-py's ``pynvml``), or None. Warnings caught: the deprecated ``pynvml``
    PyPI shim warns on import."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            import pynvml
        except ImportError:
            return None
    return pynvml


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def check_nvml(nvml: Any, pid: int, *, visible: str | None = None, torch_sees_cuda: bool = False,
               has_context: bool = False, context_error: str | None = None) -> list[Check]:
    """Two lines: NVML itself (binding, init, driver, devices), and whether it lists this pid.
    Never needed: without NVML gpumemd still reads torch's allocator; only driver-level totals and
    this process's own driver-level use are absent. On a machine with no CUDA device there is
    nothing for NVML to read, so its absence is "n/a" there and a warning only where torch sees GPUs."""
    absent: Status = "warn" if torch_sees_cuda else "n/a"
    lost = "device totals and this process's driver-level use will be absent" if torch_sees_cuda \
        else "no CUDA device here either"
    skipped = Check("nvml process", "n/a", "NVML is not available")
    if nvml is None:
        return [Check("nvml", absent, f"the binding is not installed (pip install nvidia-ml-py): {lost}"), skipped]
    try:
        nvml.nvmlInit()
    except Exception as exc:  # noqa: BLE001 - NVMLError_LibraryNotFound, DriverNotLoaded, ...
        return [Check("nvml", absent, f"not available ({type(exc).__name__}: {exc}): {lost}"), skipped]
    try:
        driver = _text(nvml.nvmlSystemGetDriverVersion())
        count = int(nvml.nvmlDeviceGetCount())
        indices = visible_indices(nvml, count, visible)
        handles = [(ordinal, nvml.nvmlDeviceGetHandleByIndex(i)) for ordinal, i in enumerate(indices)]
        detail = f"driver {driver}, {count} device{'s' if count != 1 else ''}"
        if len(indices) != count:
            detail += f", {len(indices)} visible to this process (CUDA_VISIBLE_DEVICES={visible!r})"
        if handles and not torch_sees_cuda:
            main = Check("nvml", "warn", f"{detail}, but torch cannot use them (see cuda): install a CUDA build "
                         "of torch to record device memory")
        else:
            main = Check("nvml", "ok" if handles else "warn", detail if handles else f"{detail}: none to read")
        return [main, _process_check(nvml, handles, pid, has_context, context_error)]
    finally:
        with contextlib.suppress(Exception):  # a handle that will not shut down changes no answer
            nvml.nvmlShutdown()


def _process_check(nvml: Any, handles: list[tuple[int, Any]], pid: int, has_context: bool,
                   context_error: str | None) -> Check:
    name = "nvml process"
    if not handles:
        return Check(name, "n/a", "no device visible to this process")
    if not has_context:
        why = f"no CUDA context could be created ({context_error})" if context_error else "no CUDA context"
        return Check(name, "n/a", f"not checked: {why}, so NVML would not list this process")
    others: set[int] = set()
    for ordinal, handle in handles:
        try:
            procs = nvml.nvmlDeviceGetComputeRunningProcesses(handle)
        except Exception as exc:  # noqa: BLE001 - NotSupported on some drivers and MIG
            return Check(name, "warn", f"NVML cannot list processes ({type(exc).__name__}: {exc}): per-process "
                         "used memory will be absent")
        for proc in procs:
            if int(proc.pid) == pid:
                used = getattr(proc, "usedGpuMemory", None)
                amount = format_bytes(used) if isinstance(used, int) else "amount not reported"
                return Check(name, "ok", f"NVML lists this process (pid {pid}, {amount} on device {ordinal}): "
                             "per-process used memory will be reported")
            others.add(int(proc.pid))
    if others:
        listed = ", ".join(map(str, sorted(others)[:5])) + (", ..." if len(others) > 5 else "")
        return Check(name, "warn", f"NVML lists pid(s) {listed} but not this process (pid {pid}): this process's "
                     "own GPU memory cannot be read (PID namespace, e.g. a container without --pid=host): "
                     "per-process used memory will be absent")
    return Check(name, "warn", f"NVML lists no process at all, not even this one (pid {pid}; MIG, or a driver "
                 "that hides processes): per-process used memory will be absent")


# --- host, files, network, frameworks -------------------------------------------------------------


def _dist_version(dist: str) -> str | None:
    """An installed distribution's version without importing it (frameworks import slowly)."""
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


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


def check_prometheus(wanted: bool) -> Check:
    """prometheus_client serves, pushes and writes metrics; needed only when one of those is configured."""
    version = _dist_version("prometheus-client") or _dist_version("prometheus_client")
    if version is not None:
        return Check("prometheus_client", "ok", version, needed=wanted)
    if wanted:
        return Check("prometheus_client", "fail", "not installed, and a metrics port, textfile or pushgateway is "
                     "configured: pip install prometheus-client", needed=True)
    return Check("prometheus_client", "warn", "not installed: no metrics server, textfile or push "
                 "(pip install prometheus-client)")


def check_output_dir(path: str) -> Check:
    """Writable: a temp file is created (and removed) in it, or, when it does not exist yet, in its
    nearest existing parent, where the agent would create it. Doctor never creates the directory."""
    name = "output dir"
    target = os.path.abspath(path)
    base = target
    while not os.path.lexists(base) and os.path.dirname(base) != base:
        base = os.path.dirname(base)
    if not os.path.isdir(base):
        return Check(name, "fail", f"{target} cannot be created: {base} is not a directory", needed=True)
    try:
        fd, tmp = tempfile.mkstemp(prefix=".gpumemd-doctor-", dir=base)
    except OSError as exc:
        return Check(name, "fail", f"{target} is not writable ({exc.strerror or exc}: {base})", needed=True)
    os.close(fd)
    os.unlink(tmp)
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
    out = []
    for dist, offer in _FRAMEWORKS.items():
        version = _dist_version(dist)
        out.append(Check(dist, "ok", f"{version}: {offer}") if version else Check(dist, "n/a", "not installed"))
    return out


# --- composition ----------------------------------------------------------------------------------


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
    checks += guarded("allocator", False, check_allocator, torch, env)
    checks += guarded("allocation history", False, check_history, torch)
    checks += _nvml_checks(torch, env, os.getpid() if pid is None else pid)
    checks += guarded("psutil", True, check_psutil)
    values = {n: resolve_field(n, env, given) for n in ("output_dir", "port", "bind", "textfile", "pushgateway")}
    exporting = any(values[n] not in (None, _INVALID) for n in ("port", "textfile", "pushgateway"))
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
    out = [Check("output dir", "n/a", invalid)] if values["output_dir"] is _INVALID \
        else guarded("output dir", True, check_output_dir, values["output_dir"])
    if values["port"] is _INVALID or values["bind"] is _INVALID:
        out.append(Check("metrics port", "n/a", invalid))
    else:
        identity = identity_from_env(env)
        local_rank = identity.local_rank if identity is not None else 0
        out += guarded("metrics port", values["port"] is not None, check_port, values["bind"], values["port"],
                       local_rank)
    return out
