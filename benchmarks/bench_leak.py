"""Leak detection: latency, false findings and cost (the figures in the README come from here).

    /work/venv/bin/python benchmarks/bench_leak.py            # everything (~3 minutes on 2 cores)
    /work/venv/bin/python benchmarks/bench_leak.py --quick    # fewer seeds for the statistical tables

1. Scenario suite: the real CPU training loops of tests/integration/leak_scenarios.py, under a fresh
   agent each: steps from leak onset to ``suspected`` and ``confirmed``, the kind, whether the
   holder was named; false findings over all healthy jobs; the leak component's cost per step.
2. Generated series (the LEAK_DETECTION.md setting, detector defaults: 500-step window, 64 KiB/step
   effect size here): fraction of 3000-step jobs with any finding, per null and leak model.
3. Detection latency vs leak rate and noise.
4. The pure detector's cost per step with 8 series (flat, and with one leaking).
5. The agent's step-time overhead at defaults at 10 ms and 1 ms steps, interleaved in one process
   (``--overhead-only`` for just this table).
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "integration"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench_step_overhead, when run from elsewhere


from gpumemd.analysis.leak_detector import DetectorConfig, LeakDetector, SeriesSpec  # noqa: E402

KIB, MIB = 1024, 1024 * 1024
BASE = 10 * 1024 * MIB


def scenario_table(repeats: int) -> None:
    import leak_scenarios as ls

    logging.getLogger("gpumemd").setLevel(logging.ERROR)
    print("## Scenario suite (real CPU training loops, default settings)\n")
    print(f"Settings: attach() defaults (only output_dir); leak onset at step {ls.ONSET} "
          f"({ls.LATE_ONSET} for the late one); healthy jobs run {ls.STEPS} steps.\n")
    print("| scenario | expected | found | onset → suspected | onset → confirmed | onset error | holder named | "
          "leak component µs/step | survivor scan µs/step |")
    print("|---|---|---|---|---|---|---|---|---|")
    for s in ls.LEAKS:
        out = ls.run_scenario(s, tempfile.mkdtemp(prefix="bench-leak-"))
        sus, conf = out.first("suspected"), out.first("confirmed")
        kinds = ",".join(sorted({e["kind"] for e in out.events})) or "-"
        named = conf is not None and all(h in conf["summary"] for h in s.holder)
        err = conf["onset_step"] - s.onset if conf and conf["onset_step"] is not None else "-"
        print(f"| {s.name} | {s.kind} | {kinds} | {sus['updated_step'] - s.onset if sus else 'missed'} | "
              f"{conf['updated_step'] - s.onset if conf else 'missed'} | {err} | {'yes' if named else 'no'} | "
              f"{out.leak_step_s / max(out.steps, 1) * 1e6:.0f} | {out.scan_s / max(out.steps, 1) * 1e6:.1f} |")
    false = 0
    costs = []
    for s in ls.HEALTHY:
        kinds: set[str] = set()
        scans = []
        for seed in range(repeats):
            out = ls.run_scenario(s, tempfile.mkdtemp(prefix="bench-leak-"), seed=seed)
            false += len(out.events)
            kinds.update(e["kind"] for e in out.events)
            costs.append(out.leak_step_s / max(out.steps, 1) * 1e6)
            scans.append(out.scan_s / max(out.steps, 1) * 1e6)
        found = ",".join(sorted(kinds)) or "nothing"
        print(f"| {s.name} (seeds 0-{repeats - 1}) | healthy | {found} | - | - | - | - | "
              f"{statistics.median(costs[-repeats:]):.0f} | {statistics.median(scans):.1f} |")
    print(f"\nFalse findings (state changes) over {len(ls.HEALTHY)} healthy jobs x {repeats} seeds: **{false}**. "
          f"Leak component on healthy jobs: median {statistics.median(costs):.0f} µs/step "
          "(feeding, survivor scans every 10 to 50 steps, evaluations every 50 steps).\n")


def _run(y: np.ndarray, config: DetectorConfig) -> list[tuple[int, str | None]]:
    d = LeakDetector(config)
    d.add_series(SeriesSpec("s", "tensor_leak"))
    changes = []
    for step, v in enumerate(y):
        d.observe("s", step, float(v))
        if d.due(step):
            changes += [(step, st.state_name) for st in d.evaluate(step) if st.changed]
    return changes


def _ar1(rng: np.random.Generator, n: int, phi: float, sd: float) -> np.ndarray:
    eps = rng.normal(0, sd * np.sqrt(1 - phi * phi), n)
    out = np.empty(n)
    out[0] = rng.normal(0, sd)
    for i in range(1, n):
        out[i] = phi * out[i - 1] + eps[i]
    return out


def generated_table(seeds: int) -> None:
    n = 3000
    config = DetectorConfig(min_bytes_per_step=64 * KIB)
    models = {
        "flat, ±2 MiB jitter": lambda r: BASE + r.normal(0, 2 * MIB, n),
        "heavy-tailed spikes (Pareto 1.2)": lambda r: BASE + r.pareto(1.2, n) * 4 * MIB,
        "eval buffers +500 MiB, 20 of every 200 steps": lambda r: BASE + r.normal(0, 2 * MIB, n)
        + np.where(np.arange(n) % 200 < 20, 500 * MIB, 0),
        "one-time +300 MiB step": lambda r: BASE + r.normal(0, 2 * MIB, n)
        + np.where(np.arange(n) >= r.integers(300, n - 300), 300 * MIB, 0),
        "lazy optimizer state (+2 GiB at step 1)": lambda r: BASE + r.normal(0, 2 * MIB, n)
        + np.where(np.arange(n) >= 1, 2048 * MIB, 0),
        "slow wander AR(1) φ=0.98, sd 8 MiB": lambda r: BASE + _ar1(r, n, 0.98, 8 * MIB),
        "sawtooth resetting every 150 steps": lambda r: BASE + r.normal(0, 2 * MIB, n)
        + (np.arange(n) % 150) * MIB,
        "sawtooth resetting every 1000 steps": lambda r: BASE + r.normal(0, 2 * MIB, n)
        + ((np.arange(n) + r.integers(0, 1000)) % 1000) * MIB,
        "leak 1 MiB/step from step 1000": lambda r: BASE + r.normal(0, 2 * MIB, n)
        + np.clip(np.arange(n) - 1000, 0, None) * MIB,
        "leak 128 KiB/step (2x effect size) from step 1000": lambda r: BASE + r.normal(0, 2 * MIB, n)
        + np.clip(np.arange(n) - 1000, 0, None) * 128 * KIB,
        "leak 32 KiB/step (below effect size)": lambda r: BASE + r.normal(0, 2 * MIB, n)
        + np.arange(n) * 32 * KIB,
    }
    print(f"## Generated series ({seeds} jobs of {n} steps each; window 500 steps, effect size 64 KiB/step)\n")
    print("| series | jobs with any finding | with a confirmed finding |")
    print("|---|---|---|")
    for name, gen in models.items():
        anyf = conf = 0
        for seed in range(seeds):
            changes = _run(gen(np.random.default_rng(seed)), config)
            anyf += bool(changes)
            conf += any(s == "confirmed" for _, s in changes)
        print(f"| {name} | {anyf / seeds:.2f} | {conf / seeds:.2f} |")
    print()


def latency_table(seeds: int) -> None:
    config = DetectorConfig(min_bytes_per_step=64 * KIB)
    onset, n = 1000, 2200
    print("## Detection latency (steps from onset; median over seeds; window 500, checks every 50)\n")
    print("| noise sd \\ leak rate | " + " | ".join(f"{m}x effect size" for m in (1.5, 2, 4, 16)) + " |")
    print("|---|---|---|---|---|")
    for noise in (0.1, 2.0, 8.0):
        cells = []
        for mult in (1.5, 2, 4, 16):
            sus, conf = [], []
            for seed in range(seeds):
                r = np.random.default_rng(seed)
                y = BASE + r.normal(0, noise * MIB, n)
                y[onset:] += np.arange(n - onset) * 64 * KIB * mult
                changes = _run(y, config)
                s = next((st for st, state in changes if state == "suspected"), None)
                c = next((st for st, state in changes if state == "confirmed"), None)
                sus.append(s - onset if s is not None else np.inf)
                conf.append(c - onset if c is not None else np.inf)
            cells.append(f"{statistics.median(sus):.0f} / {statistics.median(conf):.0f}")
        print(f"| {noise} MiB | " + " | ".join(cells) + " |")
    print("\n(each cell: suspected / confirmed; `inf` = not detected within the run)\n")


def cost_table() -> None:
    steps = 20_000
    rng = np.random.default_rng(0)
    print(f"## Pure detector cost ({steps} steps, 8 series, defaults: evaluation every 50 steps)\n")
    print("| case | µs/step (observe + amortised evaluate) | max evaluation ms |")
    print("|---|---|---|")
    for label, leaking in (("8 flat series", 0), ("7 flat + 1 leaking series", 1)):
        d = LeakDetector(DetectorConfig(min_bytes_per_step=64 * KIB))
        names = [f"s{i}" for i in range(8)]
        for name in names:
            d.add_series(SeriesSpec(name, "tensor_leak"))
        data = BASE + rng.normal(0, 2 * MIB, (8, steps))
        if leaking:
            data[0] += np.arange(steps) * MIB
        worst = 0.0
        start = time.perf_counter()
        for step in range(steps):
            for i, name in enumerate(names):
                d.observe(name, step, float(data[i, step]))
            if d.due(step):
                t = time.perf_counter()
                d.evaluate(step)
                worst = max(worst, time.perf_counter() - t)
        per_step = (time.perf_counter() - start) / steps * 1e6
        print(f"| {label} | {per_step:.1f} | {worst * 1e3:.1f} |")
    print()


OVERHEAD_SECONDS = {10.0: 540.0, 1.0: 90.0}
"""Measurement time per step time by default: at 10 ms one round's difference spreads over ~1 ms
(the VM's drift), so 9 minutes of rounds are what make the interval tight enough to show 1% or not
(±22.6 µs standard error in docs/overhead-and-benchmarks.md); at 1 ms 90 s is plenty."""


def overhead_table(seconds: float | None = None) -> None:
    """The agent's step-time overhead at its defaults at 10 ms and 1 ms steps (bench_step_overhead.measure:
    one job, the agent switched on and off in short blocks in random order, with the measurement's noise floor).
    ``seconds``: the measurement time of each step time (default ``OVERHEAD_SECONDS``)."""
    from bench_step_overhead import NOTES, TABLE_HEADER, measure, table_row

    times = {ms: seconds or default for ms, default in OVERHEAD_SECONDS.items()}
    print("## The agent's step-time overhead at defaults (one job, agent on/off in short interleaved blocks)\n")
    print(f"MLP with AdamW (bench_step_overhead.py), 1 thread, width chosen for the step time; {times[10.0]:g} s of "
          f"rounds at 10 ms, {times[1.0]:g} s at 1 ms. At 10 ms: batch 1,024 and blocks of 4 steps (a narrow MLP "
          "whose working set stays in cache, and short blocks that see less drift: the tightest estimate at that "
          "step time here); at 1 ms: batch 64 and blocks of 20.\n")
    print(TABLE_HEADER)
    for target_ms, target, batch, block in ((10.0, "≤ 1%", 1024, 4), (1.0, "≤ 3% (≤ 30 µs)", 64, 20)):
        print(table_row(measure(target_ms / 1e3, times[target_ms], batch=batch, block=block), target), flush=True)
    print("\n" + NOTES.format(block="4 at 10 ms, 20 at 1 ms") + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer seeds for the generated-series tables")
    parser.add_argument("--skip-scenarios", action="store_true", help="only the generated-series tables")
    parser.add_argument("--scenarios-only", action="store_true", help="only the scenario suite")
    parser.add_argument("--repeats", type=int, default=3, help="seeds of each healthy job (default 3)")
    parser.add_argument("--overhead-only", action="store_true", help="only the step-time overhead table")
    parser.add_argument("--overhead-seconds", type=float, default=None,
                        help="measurement time per step time of the overhead table (default 540 at 10 ms, "
                             "90 at 1 ms)")
    args = parser.parse_args()
    if args.overhead_only:
        overhead_table(args.overhead_seconds)
        return
    seeds = 5 if args.quick else 20
    if not args.skip_scenarios:
        scenario_table(args.repeats)
        if args.scenarios_only:
            return
        overhead_table(args.overhead_seconds)
    generated_table(seeds)
    latency_table(max(3, seeds // 4))
    cost_table()


if __name__ == "__main__":
    main()
