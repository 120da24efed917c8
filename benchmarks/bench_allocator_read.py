"""The Python side of one allocator read, on CPU with a CUDA-shaped dict: torch's ``memory_stats()``
(flattens and sorts the nested dict in Python) against gpumemd's pick of 16 keys from the nested dict.

Usage: python benchmarks/bench_allocator_read.py [--n 20000]

The nested dict is what torch's C++ binding returns on a device (2.13's 123 keys, plus one private
pool), rebuilt from ``tests/data/cuda`` recordings when there are any with ``memory_stats``, else from
the torch-shaped dict of the unit tests. The binding's own cost (building that dict in C++) is the same
for both and is not in these figures; on the H200 the whole ``memory_stats()`` call measured 75-93 µs.
"""

from __future__ import annotations

import argparse
import sys
import timeit
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "unit"))


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=20000)
    args = parser.parse_args(argv)
    import torch
    from cuda_recordings import nested_from_flat, recorded_memory_stats
    from test_probes import torch_stats

    from gpumemd.probes.device.allocator import flat_from_nested, sample_from_stats

    recorded = recorded_memory_stats()
    flat = next(iter(recorded.values())) if recorded else dict(torch_stats(3 << 30, 4 << 30))
    flat = {**flat, **{f"reserved_bytes_by_private_pools.1_0.{p}.{s}": 1 << 21
                       for p in ("all", "large_pool", "small_pool") for s in ("current", "peak", "allocated", "freed")}}
    nested = nested_from_flat(flat)
    torch.cuda.memory.memory_stats_as_nested_dict = lambda device=None: nested  # as on a device, minus C++
    old = timeit.timeit(lambda: sample_from_stats(0, torch.cuda.memory_stats(0)), number=args.n) / args.n
    new = timeit.timeit(lambda: sample_from_stats(0, flat_from_nested(nested)), number=args.n) / args.n
    source = "a recording" if recorded else "the torch-shaped dict of tests/unit/test_probes.py"
    print(f"{len(flat)} keys ({source}); per read, Python side, mean of {args.n}:")
    print(f"  memory_stats() + sample: {old * 1e6:6.1f} µs")
    print(f"  nested pick + sample:    {new * 1e6:6.1f} µs  ({old / new:.1f}x less)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
