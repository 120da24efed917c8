"""The agent's step path on CPU as it runs on a GPU: torch's CUDA calls replaced by a CUDA-shaped
allocator whose reads return a real device's stats and cost what they cost there.

Usage: python benchmarks/bench_cuda_shaped.py [--steps 4000] [--hidden 256] [--profile]

The recording (``tests/data/cuda/*.json``, from ``gpu_check.sh --record``) gives the nested stats dict
(``memory_stats_as_nested_dict``) and each call's cost on that device (``call_us``): the fakes return
that dict after a busy wait of that long. The job is the CPU MLP of ``bench_step_overhead.py``; the
agent, attached at its defaults, sees one CUDA device and reads it at every sampled step end, as on a
GPU. Prints the agent's own figure per step (training thread and all), and with ``--profile`` a
cProfile of its functions by cumulative time per step. Where a GPU run's figure is higher than this
one's, the difference is that machine's Python, not the CUDA calls (see docs/overhead-and-benchmarks.md).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))


def _busy(us: float) -> None:
    end = time.perf_counter() + us / 1e6
    while time.perf_counter() < end:
        pass


def install(recording: Path, config: str = "native") -> str:
    """Replace torch's CUDA calls the agent makes with fakes shaped and timed like ``recording``'s."""
    import torch
    from cuda_recordings import load, nested_from_flat

    data = load(recording)
    nested = nested_from_flat(data["memory_stats"][config])
    cost = data["configs"][config]["call_us"]
    total = int(data["device"]["total_memory"])

    def nested_stats(device: Any = None) -> dict[Any, Any]:
        _busy(cost["memory_stats_as_nested_dict"])
        return nested

    torch.version.cuda = data["device"].get("cuda") or "13.0"  # type: ignore[misc]
    cuda: Any = torch.cuda
    cuda.is_initialized = lambda: True
    cuda.is_available = lambda: True
    cuda.device_count = lambda: 1
    cuda.current_device = lambda: 0
    cuda.memory.memory_stats_as_nested_dict = nested_stats
    cuda.memory.get_allocator_backend = lambda: "native"
    cuda.get_per_process_memory_fraction = lambda device=None: 1.0
    cuda.get_device_properties = lambda device=None: SimpleNamespace(total_memory=total, name=data["device"]["name"])
    cuda.reset_peak_memory_stats = lambda device=None: _busy(1.0)
    cuda.mem_get_info = lambda device=None: (_busy(cost["mem_get_info"]), (total // 2, total))[1]
    cuda.host_memory_stats = lambda: {"allocated_bytes.current": 0}
    return f"{data['device']['name']}, torch {data['device']['torch']}"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=4000)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args(argv)
    from cuda_recordings import recordings

    with_costs = [p for p in recordings() if "call_us" in str(p.read_text(encoding="utf-8"))]
    if not with_costs:
        print("bench_cuda_shaped: no recording with call costs under tests/data/cuda", file=sys.stderr)
        return 2
    where = install(with_costs[-1])
    import torch
    from bench_step_overhead import make_job, time_steps

    import gpumemd

    torch.set_num_threads(1)
    job = make_job(args.hidden, 64)
    agent = gpumemd.attach(quiet=True, output_dir=tempfile.mkdtemp(prefix="gpumemd-bench-"))
    time_steps(job, 1500)  # past the leak detector's warm-up and the first census
    before, t0 = agent.overhead(), time.perf_counter()
    profiler = cProfile.Profile() if args.profile else None
    if profiler is not None:
        profiler.enable()
    time_steps(job, args.steps)
    if profiler is not None:
        profiler.disable()
    wall, after = time.perf_counter() - t0, agent.overhead()
    n = args.steps
    devices = [str(s.device) for s in agent.state().allocator]
    gpumemd.detach()
    print(f"bench_cuda_shaped: CPU MLP (width {args.hidden}) at {1e3 * wall / n:.2f} ms/step, the allocator of {where} "
          f"({', '.join(devices) or 'none read'}); {n} steps after 1,500 of warm-up")
    thread = after.training_thread_seconds_total - before.training_thread_seconds_total
    print(f"agent's own figure: {1e6 * (after.seconds_total - before.seconds_total) / n:.1f} µs/step "
          f"(training thread {1e6 * thread / n:.1f}), "
          f"{(after.samples - before.samples) / n:.3f} sampled step ends per step")
    if profiler is not None:
        rows = [(ct, tt, nc, f"{f.split('gpumemd/')[-1]}:{ln} {fn}")
                for (f, ln, fn), (_, nc, tt, ct, _) in pstats.Stats(profiler).stats.items()  # type: ignore[attr-defined]
                if "/gpumemd/" in f]
        for ct, tt, nc, name in sorted(rows, reverse=True)[:30]:
            print(f"{1e6 * ct / n:8.2f} µs/step cum {1e6 * tt / n:7.2f} own {nc / n:6.3f}/step  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
