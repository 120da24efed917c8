"""Exporter cost: scrape latency at 8 devices with a full census, and step overhead while scraped 10x/s.

    /work/venv/bin/python benchmarks/bench_exporter.py [--scrapes 500] [--steps 3000] [--rounds 3]
    /work/venv/bin/python benchmarks/bench_exporter.py --storm [--clients 64] [--modes partial,idle,mixed]
        [--storm-scrapes 30] [--interval 0.5] [--timeout 10] [--prometheus /usr/bin/prometheus]

Scrape latency: one ``AgentState`` with 8 devices of allocator samples (built from flattened
``torch.cuda.memory_stats`` dicts, as the probe builds them), 8 NVML devices, a census of
``--groups`` groups and 5 leak findings. Timed three ways: building the metric families,
rendering the text exposition, and a full HTTP GET of ``/metrics`` on loopback through the real
server. Median and p99 over ``--scrapes`` runs.

Step overhead: a CPU MLP training loop with the agent attached (exporter on, port 0), timed with
a scraper thread fetching ``/metrics`` every 100 ms against the same loop unscraped, alternating
``--rounds`` times (median of the per-round mean step times), torch on one thread. Prints markdown
tables.

Storm (``--storm``, instead of the two above): the server at its defaults serves the same state while
``--clients`` hostile clients in another process (``tests/unit/exporter_storm.py``) connect, send part
of a request (``partial``), nothing (``idle``) or either (``mixed``), and reconnect the moment they
are dropped; a Prometheus-style scraper (its headers, one ``--timeout`` for the whole scrape) makes
``--storm-scrapes`` scrapes every ``--interval`` s. Per mode: scrapes within their timeout, their
latency, the storm's connections per second, the most exporter threads seen and the CPU the
exporter's process spent (its main thread only scrapes: nearly all of it is the server's). With
``--prometheus BINARY`` the scraper is a real Prometheus instead (every 1 s, 1 s timeout, for
``--storm-scrapes`` seconds): its ``up`` and ``scrape_duration_seconds`` samples.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
import urllib.request
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "unit"))  # exporter_storm
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "e2e"))  # prometheus_server

MIB = 1024**2
GIB = 1024**3


def _stats(device: int) -> dict[str, int]:
    stats = {f"{s}.{p}.{k}": 0 for s in ("allocation", "segment", "active", "inactive_split", "allocated_bytes",
                                          "reserved_bytes", "active_bytes", "inactive_split_bytes", "requested_bytes")
             for p in ("all", "large_pool", "small_pool") for k in ("current", "peak", "allocated", "freed")}
    stats.update({
        "allocated_bytes.all.current": (30 + device) * GIB, "allocated_bytes.all.peak": 60 * GIB,
        "reserved_bytes.all.current": 70 * GIB, "reserved_bytes.all.peak": 72 * GIB,
        "active_bytes.all.current": 31 * GIB, "inactive_split_bytes.all.current": 2 * GIB,
        "requested_bytes.all.current": 30 * GIB, "segment.all.current": 900, "num_alloc_retries": 3,
        "num_ooms": 0, "num_device_alloc": 950, "num_device_free": 50,
    })
    return stats


def big_state(groups: int) -> Any:
    from gpumemd.probes.device.allocator import sample_from_stats
    from gpumemd.records.census import CATEGORIES, Census, CensusGroup, GroupKey
    from gpumemd.records.device import Device
    from gpumemd.records.findings import Finding
    from gpumemd.records.samples import HostSample, NvmlDeviceSample
    from gpumemd.records.step import AgentState, Identity, StepRecord

    allocator = tuple(s for d in range(8) if (s := sample_from_stats(d, _stats(d))) is not None)
    census = Census(
        step=1000, taken_at=0.0, duration_s=0.3,
        groups=tuple(
            CensusGroup(GroupKey(Device.cuda(i % 8), "bfloat16", (i, 4096), CATEGORIES[i % 6], f"layer{i}.w"),
                        1 + i % 3, i * 8192)
            for i in range(groups)
        ),
    )
    findings = tuple(
        Finding(kind=kind, series=f"s{i}", state="suspected", slope_bytes_per_step=1e6, slope_low=9e5,
                slope_high=1.1e6, onset_step=10, growth_bytes=10**9, steps_to_oom=5e4, first_step=100,
                updated_step=900, summary="", device=Device.cuda(i))
        for i, kind in enumerate(("tensor_leak", "graph_leak", "fragmentation", "non_pytorch", "host_leak"))
    )
    return AgentState(
        identity=Identity(rank=3, local_rank=3, world_size=64, hostname="node-a", pid=1, source="torchrun"),
        attached_at=0.0, updated_at=1.0, step=1000, steps_total=1001,
        last_step=StepRecord(step=1000, wall_time=1.0, duration_s=0.5, allocator=allocator),
        allocator=allocator,
        nvml=tuple(NvmlDeviceSample(Device.cuda(d), 80 * GIB, 72 * GIB, 8 * GIB, 71 * GIB) for d in range(8)),
        host=HostSample(rss_bytes=40 * GIB, available_bytes=900 * GIB, total_bytes=1024 * GIB, pinned_bytes=GIB),
        census=census, censuses_total=12, findings=findings,
        probe_errors={"allocator": 0, "nvml": 0, "host": 0},
        probes_available={"allocator": True, "nvml": True, "host": True},
    )


def _quantiles(times: list[float]) -> tuple[float, float]:
    times = sorted(times)
    return statistics.median(times), times[min(len(times) - 1, int(len(times) * 0.99))]


def bench_scrape(scrapes: int, groups: int) -> list[tuple[str, float, float, int]]:
    from prometheus_client import CollectorRegistry, generate_latest

    from gpumemd.exporter.collector import CounterBaseline, StateCollector, build_families
    from gpumemd.exporter.server import MetricsServer, ServeOptions

    state = big_state(groups)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StateCollector(lambda: state, CounterBaseline()))
    size = len(generate_latest(registry))
    rows = []
    for label, fn in (
        ("build families", lambda: build_families(state)),
        ("render exposition", lambda: generate_latest(registry)),
    ):
        times = []
        for _ in range(scrapes):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        rows.append((label, *_quantiles(times), size))
    server = MetricsServer(registry, ServeOptions(port=0))
    url = server.start()
    try:
        times = []
        for _ in range(scrapes):
            start = time.perf_counter()
            with urllib.request.urlopen(url, timeout=10) as response:
                response.read()
            times.append(time.perf_counter() - start)
        rows.append(("HTTP GET /metrics (loopback)", *_quantiles(times), size))
    finally:
        server.stop()
    return rows


def _prometheus_scrapes(binary: str, port: int, seconds: int) -> Any:
    """A real Prometheus (its e2e set-up: scrape every 1 s, 1 s timeout) scrapes ``port`` for ``seconds``:
    each scrape's ``up`` and ``scrape_duration_seconds``, as ``exporter_storm.Scrapes``."""
    import tempfile
    from pathlib import Path

    from exporter_storm import Scrapes
    from prometheus_server import Prometheus

    prom = Prometheus(binary, Path(tempfile.mkdtemp(prefix="gpumemd-bench-prometheus-")))
    prom.start([f"127.0.0.1:{port}"], [])
    try:
        time.sleep(seconds + 1.5)
        up = prom.api("query", query=f'up{{job="gpumemd"}}[{seconds}s]')["result"][0]["values"]
        took = prom.api("query", query=f'scrape_duration_seconds{{job="gpumemd"}}[{seconds}s]')["result"][0]["values"]
    finally:
        prom.stop()
    seen = Scrapes(timeout_s=1.0)
    for (_, value), (_, duration) in zip(up, took, strict=True):
        if value == "1":
            seen.ok.append(float(duration))
        else:
            seen.failed.append(f"up 0 after {float(duration):.2f} s")
    return seen


def bench_storm(clients: int, mode: str, *, scrapes: int, interval_s: float, timeout_s: float,
                groups: int, prometheus: str | None) -> dict[str, Any]:
    import exporter_storm
    from prometheus_client import CollectorRegistry

    from gpumemd.exporter.collector import CounterBaseline, StateCollector
    from gpumemd.exporter.connections import THREAD_NAME
    from gpumemd.exporter.server import MetricsServer, ServeOptions

    state = big_state(groups)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StateCollector(lambda: state, CounterBaseline()))
    server = MetricsServer(registry, ServeOptions(port=0))
    server.start()
    assert server.port is not None
    threads = [0]
    done = threading.Event()

    def count_threads() -> None:
        while not done.wait(0.02):
            threads[0] = max(threads[0], sum(t.name.startswith(THREAD_NAME) for t in threading.enumerate()))

    watcher = threading.Thread(target=count_threads, daemon=True)
    watcher.start()
    storm = exporter_storm.start_storm(server.port, clients, mode)
    try:
        time.sleep(1.0)  # the storm at full strength before the first scrape
        start, cpu = time.monotonic(), time.process_time()
        if prometheus:
            seen = _prometheus_scrapes(prometheus, server.port, scrapes)
        else:
            seen = exporter_storm.scrape_series(server.port, scrapes, interval_s=interval_s, timeout_s=timeout_s,
                                                expect=b"gpumemd_info")
        elapsed, cpu = time.monotonic() - start, time.process_time() - cpu
    finally:
        made = exporter_storm.stop_storm(storm)
        done.set()
        watcher.join()
        server.stop()
    ok = sorted(seen.ok) or [float("nan")]
    return {"mode": mode, "ok": len(seen.ok), "total": seen.total, "median": statistics.median(ok),
            "p90": ok[min(len(ok) - 1, int(len(ok) * 0.9))], "max": ok[-1], "rate": made / (elapsed + 1.0),
            "threads": threads[0], "cpu": cpu / elapsed, "failed": seen.failed[:3]}


def _train(steps: int, url: str | None) -> float:
    import torch

    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(64, 256), torch.randint(0, 10, (64,))
    stop = threading.Event()
    scraped = [0]

    def scraper() -> None:
        assert url is not None
        while not stop.wait(0.1):
            with urllib.request.urlopen(url, timeout=10) as response:
                response.read()
            scraped[0] += 1

    thread = threading.Thread(target=scraper, name="bench-scraper", daemon=True) if url else None
    if thread is not None:
        thread.start()
    start = time.perf_counter()
    for _ in range(steps):
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
    elapsed = time.perf_counter() - start
    stop.set()
    if thread is not None:
        thread.join(10)
        if elapsed > 1.0:
            assert scraped[0] > 0, "the scraper never ran"
    return elapsed / steps


def bench_overhead(steps: int, rounds: int) -> tuple[float, float]:
    import torch

    import gpumemd

    torch.set_num_threads(1)  # one intra-op thread: steadier timings on a shared machine
    quiet, scraped = [], []
    agent = gpumemd.attach(port=0, output_dir="/tmp/gpumemd-bench-exporter", sample_interval_s=5.0)
    try:
        url = agent.exporter_url
        _train(200, None)  # warm-up
        for _ in range(rounds):
            quiet.append(_train(steps, None))
            scraped.append(_train(steps, url))
    finally:
        gpumemd.detach()
    return statistics.median(quiet), statistics.median(scraped)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--scrapes", type=int, default=500)
    parser.add_argument("--groups", type=int, default=2000, help="census groups in the scraped state")
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--storm", action="store_true", help="only the storm of reconnecting clients")
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--modes", default="partial,idle,mixed")
    parser.add_argument("--storm-scrapes", type=int, default=30)
    parser.add_argument("--interval", type=float, default=0.5, help="seconds between scrape starts")
    parser.add_argument("--timeout", type=float, default=10.0, help="a scrape's timeout (Prometheus: 10 s)")
    parser.add_argument("--prometheus", metavar="BINARY",
                        help="the scraper is this Prometheus, every 1 s with a 1 s timeout, for --storm-scrapes s")
    args = parser.parse_args(argv)
    if args.storm:
        return storm_main(args)

    print(f"Scrape latency, 8 devices, census of {args.groups} groups, 5 findings ({args.scrapes} scrapes)\n")
    print("| what | median | p99 | exposition |")
    print("|---|---|---|---|")
    for label, median, p99, size in bench_scrape(args.scrapes, args.groups):
        print(f"| {label} | {median * 1e3:.2f} ms | {p99 * 1e3:.2f} ms | {size / 1024:.1f} KiB |")

    quiet, scraped = bench_overhead(args.steps, args.rounds)
    print(f"\nTraining step while scraped 10x/s (CPU MLP, {args.steps} steps x {args.rounds} rounds, medians)\n")
    print("| loop | mean step | vs unscraped |")
    print("|---|---|---|")
    print(f"| agent attached, not scraped | {quiet * 1e3:.3f} ms | |")
    print(f"| agent attached, scraped every 100 ms | {scraped * 1e3:.3f} ms | {(scraped / quiet - 1) * 100:+.1f}% |")
    return 0


def storm_main(args: argparse.Namespace) -> int:
    scraper = (f"Prometheus, {args.storm_scrapes} s of scrapes every 1 s, 1 s timeout" if args.prometheus else
               f"{args.storm_scrapes} scrapes every {args.interval:g} s, {args.timeout:g} s timeout")
    print(f"Scrapes through {args.clients} clients reconnecting at once ({scraper}; census of {args.groups} "
          "groups)\n")
    print("| clients send | scrapes ok | median | p90 | max | storm connects/s | exporter threads (max) "
          "| process CPU |")
    print("|---|---|---|---|---|---|---|---|")
    failures = []
    for mode in args.modes.split(","):
        r = bench_storm(args.clients, mode, scrapes=args.storm_scrapes, interval_s=args.interval,
                        timeout_s=args.timeout, groups=args.groups, prometheus=args.prometheus)
        print(f"| {mode} | {r['ok']}/{r['total']} | {r['median'] * 1e3:.0f} ms | {r['p90'] * 1e3:.0f} ms "
              f"| {r['max'] * 1e3:.0f} ms | {r['rate']:.0f} | {r['threads']} | {r['cpu'] * 100:.0f}% of a core |")
        failures += [f"{mode}: {f}" for f in r["failed"]]
    for line in failures:
        print(f"\nfailed: {line}", end="")
    print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
