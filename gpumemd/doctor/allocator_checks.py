"""The CUDA caching allocator: its backend, its settings, and whether allocation history is on."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gpumemd.doctor.check import Check, Status
from gpumemd.doctor.torch_checks import cuda_ready
from gpumemd.probes.device.allocator import ALLOC_CONF_VARS


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
    present = [(var, environ[var]) for var in ALLOC_CONF_VARS if environ.get(var, "").strip()]
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
