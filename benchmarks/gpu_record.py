"""Record, from a real CUDA device, what the CPU tests replay: ``python benchmarks/gpu_record.py DIR``.

Writes ``DIR/cuda-<gpu>-torch<version>.json`` and, beside it, one allocator snapshot with history per
configuration (``DIR/<stem>-snapshot-<config>.pickle``, what ``torch.cuda.memory._snapshot()``
returned). Copy them to ``tests/data/cuda/`` and commit: ``tests/cuda_recordings.py`` loads them, and
the probe, parser and report tests run on them.

The JSON holds, per allocator configuration (native, ``expandable_segments:True``,
``backend:cudaMallocAsync``; each in a fresh process, as torch reads the setting at CUDA's start):
``memory_stats()`` after a few training steps and after an OOM the job caught, the OOM's message, the
arguments torch passed the OOM observer, and ``mem_get_info``; once: ``get_device_properties`` and the
NVML readings (v1 and v2 memory info, this process's entry). Run by ``gpu_check.sh --record DIR``.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import timeit
from pathlib import Path
from typing import Any

CONFIGS = {"native": "", "expandable_segments": "expandable_segments:True",
           "cudaMallocAsync": "backend:cudaMallocAsync"}


def _train(torch: Any, steps: int = 3) -> Any:
    model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 1024)).cuda()
    opt = torch.optim.AdamW(model.parameters())
    for _ in range(steps):
        model(torch.randn(256, 1024, device="cuda")).pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model


def _oom(torch: Any) -> str:
    """One OOM the job catches: a request of twice the device's memory. Its message as torch wrote it."""
    total = torch.cuda.get_device_properties(0).total_memory
    try:
        torch.empty(2 * total, dtype=torch.uint8, device="cuda")
    except torch.OutOfMemoryError as exc:
        return str(exc)
    return ""


def record_one(config: str, stem: Path) -> dict[str, Any]:
    """In this process (started with the configuration's PYTORCH_CUDA_ALLOC_CONF): this config's facts."""
    import torch

    observed: list[list[int]] = []
    try:
        torch._C._cuda_attach_out_of_memory_observer(  # as gpumemd's OOM capture attaches it
            lambda device, alloc, device_allocated, device_free: observed.append(
                [int(device), int(alloc), int(device_allocated), int(device_free)]))
        observer = ""
    except RuntimeError as exc:  # cudaMallocAsync (torch 2.11): "does not yet support attachOutOfMemoryObserver"
        observer = str(exc)
    history = config != "cudaMallocAsync"  # the async backend keeps no history
    if history:
        torch.cuda.memory._record_memory_history(max_entries=2000)
    model = _train(torch)
    facts: dict[str, Any] = {"backend": torch.cuda.memory.get_allocator_backend(),
                             "memory_stats": dict(torch.cuda.memory_stats(0))}
    facts["oom_message"] = _oom(torch)
    facts["oom_observer_args"] = observed  # (device, requested, device_allocated, device_free)
    if observer:
        facts["oom_observer_error"] = observer
    facts["memory_stats_after_oom"] = dict(torch.cuda.memory_stats(0))
    facts["mem_get_info"] = list(torch.cuda.mem_get_info(0))
    facts["call_us"] = _call_costs(torch)
    if history:
        snapshot = torch.cuda.memory._snapshot()
        path = stem.with_name(f"{stem.name}-snapshot-{config}.pickle")
        with path.open("wb") as f:
            pickle.dump(snapshot, f)
        facts["snapshot"] = path.name
        torch.cuda.memory._record_memory_history(enabled=None)
    del model
    return facts


def _call_costs(torch: Any, n: int = 2000) -> dict[str, float]:
    """Microseconds per call, on this device, of what the agent calls on the training thread: the CPU
    tests' CUDA-shaped allocator costs what these say (each the median of 5 runs of ``n`` calls)."""
    import statistics

    from gpumemd.probes.device.allocator import flat_from_nested

    nested = torch.cuda.memory.memory_stats_as_nested_dict
    calls = {"memory_stats_as_nested_dict": lambda: nested(0),
             "flat_from_nested(memory_stats_as_nested_dict)": lambda: flat_from_nested(nested(0)),
             "memory_stats": lambda: torch.cuda.memory_stats(0),
             "memory_allocated": lambda: torch.cuda.memory_allocated(0),
             "mem_get_info": lambda: torch.cuda.mem_get_info(0),
             "is_initialized": torch.cuda.is_initialized,
             "current_device": torch.cuda.current_device}
    return {name: round(1e6 * statistics.median(timeit.repeat(fn, number=n, repeat=5)) / n, 3)
            for name, fn in calls.items()}


def _device_facts() -> dict[str, Any]:
    import torch

    props = torch.cuda.get_device_properties(0)
    keys = ("name", "total_memory", "major", "minor", "multi_processor_count")
    out: dict[str, Any] = {k: getattr(props, k) for k in keys if hasattr(props, k)}
    out["uuid"] = str(getattr(props, "uuid", ""))
    out["torch"] = torch.__version__
    out["cuda"] = torch.version.cuda
    out["device_count"] = torch.cuda.device_count()
    return out


def _nvml_facts() -> dict[str, Any]:
    try:
        import pynvml
    except ImportError:
        return {"absent": "pynvml is not installed"}
    pynvml.nvmlInit()
    try:
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        v1 = pynvml.nvmlDeviceGetMemoryInfo(handle)
        out: dict[str, Any] = {"count": pynvml.nvmlDeviceGetCount(),
                               "driver": _text(pynvml.nvmlSystemGetDriverVersion()),
                               "uuid": _text(pynvml.nvmlDeviceGetUUID(handle)),
                               "memory_v1": {"total": v1.total, "used": v1.used, "free": v1.free}}
        if hasattr(pynvml, "nvmlMemory_v2"):
            v2 = pynvml.nvmlDeviceGetMemoryInfo(handle, version=pynvml.nvmlMemory_v2)
            out["memory_v2"] = {"total": v2.total, "used": v2.used, "free": v2.free, "reserved": v2.reserved}
        out["processes"] = [{"pid": p.pid, "usedGpuMemory": p.usedGpuMemory}
                            for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle)]
        out["this_pid"] = os.getpid()
        out["call_us"] = {name: round(1e6 * min(timeit.repeat(fn, number=200, repeat=3)) / 200, 3) for name, fn in {
            "nvmlDeviceGetMemoryInfo": lambda: pynvml.nvmlDeviceGetMemoryInfo(handle),
            "nvmlDeviceGetComputeRunningProcesses":
                lambda: pynvml.nvmlDeviceGetComputeRunningProcesses(handle)}.items()}
        return out
    finally:
        pynvml.nvmlShutdown()


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def main(argv: list[str]) -> int:
    if len(argv) == 3 and argv[0] == "--one":  # a child: one configuration, facts as JSON on stdout
        print(json.dumps(record_one(argv[1], Path(argv[2]))))
        return 0
    if len(argv) != 1:
        print("usage: python benchmarks/gpu_record.py DIR", file=sys.stderr)
        return 2
    import torch

    if not torch.cuda.is_available():
        print("gpu_record: no CUDA device here; nothing recorded", file=sys.stderr)
        return 2
    out = Path(argv[0])
    out.mkdir(parents=True, exist_ok=True)
    device = _device_facts()
    gpu = "".join(c if c.isalnum() else "-" for c in str(device["name"]).lower()).strip("-")
    stem = out / f"cuda-{gpu}-torch{torch.__version__.split('+')[0]}"
    data: dict[str, Any] = {"device": device, "configs": {}}
    for config, conf in CONFIGS.items():
        env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": conf} if conf else dict(os.environ)
        proc = subprocess.run([sys.executable, __file__, "--one", config, str(stem)], capture_output=True,
                              text=True, timeout=120, env=env)
        if proc.returncode != 0:
            data["configs"][config] = {"failed": proc.stderr[-2000:]}
            continue
        data["configs"][config] = json.loads(proc.stdout.strip().splitlines()[-1])
    data["memory_stats"] = {f"{c}{suffix}": facts[key] for c, facts in data["configs"].items()
                            for key, suffix in (("memory_stats", ""), ("memory_stats_after_oom", "-after-oom"))
                            if key in facts}
    data["nvml"] = _nvml_facts()
    path = stem.with_name(stem.name + ".json")  # not with_suffix: "torch2.11.0" ends in ".0"
    tmp = stem.with_name(stem.name + ".json.tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True), encoding="utf-8")
    tmp.replace(path)
    print(f"gpu_record: wrote {path} ({', '.join(data['memory_stats'])})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
