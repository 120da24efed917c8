"""What ``attach()`` + ``detach()`` cost in a warm interpreter (torch and gpumemd imported), at defaults.

Usage: python benchmarks/bench_attach.py [--repeats 20]

Each figure is from fresh processes where it must be: the *first* attach of a process imports the
components (lazily, to keep ``import gpumemd`` light), so it is timed in ``--fresh`` (5) new processes;
the median of ``--repeats`` attach/detach pairs after it is what a job that attaches per phase, or a
test suite, pays each time. Options are passed (``quiet``, ``output_dir``) as a job would: that path
once parsed Config's source (80-90 ms on the H200 machine) on every attach.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time


def child(repeats: int) -> dict[str, float]:
    import torch  # noqa: F401 - a training script has imported it before attach

    import gpumemd

    out = tempfile.mkdtemp(prefix="gpumemd-bench-attach-")
    t0 = time.perf_counter()
    gpumemd.attach(quiet=True, output_dir=out)
    first_attach = time.perf_counter() - t0
    gpumemd.detach()
    pairs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        gpumemd.attach(quiet=True, output_dir=out)
        gpumemd.detach()
        pairs.append(time.perf_counter() - t0)
    return {"first_attach_ms": 1e3 * first_attach, "pair_median_ms": 1e3 * statistics.median(pairs)}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--fresh", type=int, default=5)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.repeats)))
        return 0
    runs = []
    for _ in range(args.fresh):
        proc = subprocess.run([sys.executable, __file__, "--child", "--repeats", str(args.repeats)],
                              capture_output=True, text=True, timeout=300, check=True)
        runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    first = sorted(r["first_attach_ms"] for r in runs)
    pair = sorted(r["pair_median_ms"] for r in runs)
    print(f"first attach() of a process: median {statistics.median(first):.1f} ms "
          f"(range {first[0]:.1f}-{first[-1]:.1f}, {args.fresh} processes)")
    print(f"attach() + detach() after it: median {statistics.median(pair):.1f} ms "
          f"(range {pair[0]:.1f}-{pair[-1]:.1f}, median of {args.repeats} pairs per process)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
