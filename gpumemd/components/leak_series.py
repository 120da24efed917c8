"""The leak component's series: what each step record, survivor scan and census feeds the detector,
and the growth per step that matters for each.

Series fed per step (all cheap reads of the ``StepRecord`` and the published state):

- CUDA, per device: step-end ``allocated`` (tensor/graph leak), ``inactive_split`` (fragmentation:
  absent under expandable segments and cudaMallocAsync, which do not maintain it), NVML used −
  reserved (memory outside PyTorch's allocator).
- Host RSS (host leak) — unless the census of CPU tensors grows as fast, which makes it theirs.
- The job's child processes (DataLoader workers), every few steps: their RSS growth since each was
  first seen (``analysis.worker_growth``: a restarted worker starts again from nothing).
- Census, per device, whenever a new census is published: total bytes including the autograd graph
  it keeps alive (on CPU this is the tensor/graph leak alarm), and CUDA's allocated − census
  ("invisible", i.e. autograd-saved tensors), which turns an allocated-bytes leak into a graph leak.
- Per survivor scan: long-lived tensors per group and autograd nodes per graph chain (count series),
  and the bytes of the largest new tensor of each family that keeps growing (``tensor_families``:
  a tensor replaced each step by a larger one).

The threshold of each series is its noise floor or, above it, what would exhaust the headroom the
series draws on within ``leak_horizon_hours`` at the measured step rate.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import TYPE_CHECKING

from gpumemd.analysis.headroom import reservable_bytes
from gpumemd.analysis.leak_detector import DetectorConfig, LeakDetector, SeriesSpec, TrackStatus
from gpumemd.analysis.leak_types import series_family, series_name
from gpumemd.analysis.worker_growth import WorkerGrowth
from gpumemd.components.leak_counts import CountFeeding
from gpumemd.components.leak_specs import measure_spec
from gpumemd.records.device import CPU, Device, cuda_index

if TYPE_CHECKING:
    from gpumemd.components.base import AgentView
    from gpumemd.components.leak_options import LeakOptions
    from gpumemd.probes.survival.graph_chains import GraphChainTracker
    from gpumemd.probes.survival.survivors import SurvivorTracker
    from gpumemd.probes.survival.tensor_families import TensorFamilies
    from gpumemd.records.census import Census
    from gpumemd.records.samples import AllocatorSample, HostSample
    from gpumemd.records.step import StepRecord


# Noise floors: the smallest growth per step each kind of series (its finding kind) can tell from its
# own noise, whatever the materiality. The allocator's and the census's counters (tensor and graph
# series) are exact; host RSS moves in pages and malloc chunks; inactive split bytes and NVML move in
# allocator blocks and segments.
NOISE_FLOOR_BYTES = {
    "tensor_leak": 1024.0,
    "graph_leak": 1024.0,
    "host_leak": 16 * 1024.0,  # a Hugging Face Trainer fit drifts by ~2-9 KiB/step of RSS while it warms up
    "fragmentation": 256 * 1024.0,
    "non_pytorch": 256 * 1024.0,
}
RSS_BURST_BYTES = 8 * 1024 * 1024
"""Host RSS rises in malloc-arena bursts of a few MiB while heaps warm up (measured: 3-6 MiB in the demo
and a Hugging Face Trainer fit). Over a short window one burst looks like a slope, so the host floor is
at least this much per window: 16 KiB/step at the default 500-step window, more for shorter ones."""

COUNT_FLOOR = 0.1
"""Long-lived tensors per step below which a count series never fires (one per 10 steps)."""

WAITING_MAX = 32
"""Records waiting for the detector at most (they are fed at each evaluation, every 50 steps by default)."""


class LeakSeries:
    """Feeds the detector (one per start) and says what growth matters; see the module docstring. What
    a survivor scan feeds (``scans.feed_counts``) is its part ``scans`` (``leak_counts.CountFeeding``).

    ``tracker`` and ``chains`` (None when long-lived tensor tracking is off) give the count series."""

    def __init__(self, options: LeakOptions, agent: AgentView, *, tracker: SurvivorTracker | None,
                 chains: GraphChainTracker | None, families: TensorFamilies | None = None) -> None:
        self._options = options
        self._agent = agent
        self.detector = LeakDetector(DetectorConfig(
            min_bytes_per_step=options.leak_min_bytes_per_step or NOISE_FLOOR_BYTES["tensor_leak"],
            warmup_steps=options.leak_warmup_steps,
            window_steps=options.leak_window_steps,
            check_every_steps=options.leak_check_every_steps,
        ))
        # What a survivor scan feeds: its count, chain and family series (the culprit search reads them there).
        self.scans = CountFeeding(self.detector, self._observe, tracker=tracker, chains=chains, families=families)
        self.host_spec = SeriesSpec(
            series_name("host_rss_bytes"), "host_leak", CPU,
            explained_by=(series_name("census_bytes", CPU), series_name("long_lived_bytes", CPU),
                          series_family("tensors", CPU), series_family("graph_nodes", CPU),
                          series_family("growing_tensor_bytes", CPU)))
        self.workers_spec = SeriesSpec(series_name("workers_rss_bytes"), "host_leak", CPU)
        self.worker_growth = WorkerGrowth()
        self.seconds_per_step: float | None = None  # the mean step time, pauses included: time-to-OOM projections
        self._known: set[str] = set()
        self._waiting: list[tuple[StepRecord, int]] = []  # records not yet fed (``wait``)
        self._own_record_bytes: float | None = None
        self._last_host: tuple[float, HostSample] | None = None  # the newest fed step's (wall time, host)
        self._last_allocator: tuple[float, tuple[AllocatorSample, ...]] | None = None  # ... and its allocator
        self._last_census: Census | None = None
        # Per (measured series, finding's series, phase): the rate since the finding's onset, with the
        # onset and the step it was worked out at (``_rate_since``).
        self._rates: dict[tuple[str, str, str], tuple[int, int, float | None]] = {}

    # --- feeding -------------------------------------------------------------------------------

    def _observe(self, spec: SeriesSpec, step: int, value: float, phase: str) -> None:
        if spec.name not in self._known:
            self._known.add(spec.name)
            self.detector.add_series(spec)
        self.detector.observe(spec.name, step, value, phase)

    def wait(self, record: StepRecord, samples: int) -> None:
        """Keep a record for the detector: fed with the others, in one loop, just before an evaluation
        reads them (``feed_waiting``), or once ``WAITING_MAX`` wait. A sampled step end runs after a
        step of compute, with the code and data out of the cache: there a detector call costs ~20 µs,
        in the loop ~2 µs. Same values in the same order: the detector decides the same."""
        self._waiting.append((record, samples))
        if len(self._waiting) >= WAITING_MAX:
            self.feed_waiting()

    def feed_waiting(self) -> None:
        waiting, self._waiting = self._waiting, []
        for record, samples in waiting:
            self.feed(record, samples)

    def feed(self, record: StepRecord, samples: int) -> None:
        """Feed one record's series (``samples``: the agent's records made when it was)."""
        step, phase = record.step, record.phase
        nvml = {n.device: n for n in record.nvml} if record.allocator else {}
        for a in record.allocator:
            d = a.device
            if a.allocated_bytes is not None:
                # A private pool (CUDA graphs under "reduce-overhead") grows with each graph recorded
                # and holds its blocks for replays: the pool's growth, not a tensor leak.
                outside_pools = max(0, a.allocated_bytes - (a.private_pool_reserved_bytes or 0))
                self._observe(measure_spec("allocated_bytes", "tensor_leak", d), step, outside_pools, phase)
            if a.inactive_split_bytes is not None:
                # Fragmentation is what empty_cache() cannot release: inactive split blocks. Reserved −
                # allocated also holds whole cached segments, which the allocator frees and retries
                # with before any OOM: their growth is a cache, not fragmentation.
                self._observe(measure_spec("inactive_split_bytes", "fragmentation", d),
                              step, a.inactive_split_bytes, phase)
            n = nvml.get(d)
            # This process's own use only: the device's total use would count other processes (and,
            # under torchrun, the other ranks) as this job's non-PyTorch growth.
            if n is not None and a.reserved_bytes is not None and n.process_used_bytes is not None:
                self._observe(measure_spec("non_pytorch_bytes", "non_pytorch", d), step,
                              n.process_used_bytes - a.reserved_bytes, phase)
        duration = record.duration_s
        if duration is not None and duration > 0:
            avg = self.seconds_per_step
            self.seconds_per_step = duration if avg is None else 0.98 * avg + 0.02 * duration
        if record.allocator:
            self._last_allocator = (record.wall_time, record.allocator)
        host = record.host
        if host is not None:
            self._last_host = (record.wall_time, host)
            # The agent's own step records grow until the ring buffer is full: not the job's memory.
            own = self._own_record_bytes
            if own is None:
                own = self._own_record_bytes = float(_deep_size(record))
            # Pages mapped from files (a memory-mapped dataset read through, as Arrow and np.memmap are) are
            # page cache the kernel takes back when memory runs short: RSS that grows with them is no leak.
            # (statm counts shared memory with them: a job's are tensors, which the count series see.)
            value = host.rss_bytes - (host.file_bytes or 0) - own * min(samples, self._options.keep_steps)
            if self.host_spec.name in self._known:  # ``_observe``, inlined: a dense point per sampled step
                self.detector.observe(self.host_spec.name, step, value, phase)
            else:
                self._observe(self.host_spec, step, value, phase)
        workers = record.workers
        if workers is not None and (workers.workers or self.worker_growth.seen):
            grown = self.worker_growth.update((w.pid, w.rss_bytes - (w.file_bytes or 0)) for w in workers.workers)
            self._observe(self.workers_spec, step, grown, phase)

    def feed_census(self, census: Census | None, record: StepRecord) -> None:
        """Feed a census's series, once per census (the one published when ``record`` was made)."""
        if census is None or census is self._last_census:
            return
        self._last_census = census
        step = census.step if census.step is not None else record.step
        cuda_devices = {a.device for a in record.allocator if a.allocated_bytes is not None}
        for dev, nbytes in census.bytes_by_device().items():
            # On CUDA the allocator's step-end bytes are the alarm; the census only attributes.
            # CPU tensors are watched by the count series and host RSS; the census attributes.
            alarm = False if dev.cuda_index is None else dev not in cuda_devices
            self._observe(measure_spec("census_bytes", "tensor_leak", dev, sparse=True, alarm=alarm),
                          step, nbytes, record.phase)
        for dev, nbytes in census.invisible_bytes_by_device.items():
            self._observe(measure_spec("invisible_bytes", "graph_leak", dev, sparse=True, alarm=False),
                          step, nbytes, record.phase)

    # --- what matters --------------------------------------------------------------------------

    def evaluate(self, step: int) -> list[TrackStatus]:
        """The detector's statuses at this step, each series judged against the growth that matters."""
        return self.detector.evaluate(step, self._min_slopes())

    def rising_names(self) -> set[str]:
        """Series whose floor rose enough at the last evaluation to be assessed in full."""
        return {name for name, _ in self.detector.rising}

    def _min_slopes(self) -> dict[str, float]:
        """Per series, the growth per step that matters: what would exhaust the headroom it draws on
        within ``leak_horizon_hours`` at the measured step rate, never below its noise floor (or the
        fixed effect size the user set)."""
        c = self._options
        out: dict[str, float] = {}
        headrooms: dict[Device | None, float | None] = {}  # one per device
        for spec in self.detector.series():
            if spec.unit != "bytes":
                out[spec.name] = COUNT_FLOOR
                continue
            host = spec.kind == "host_leak"
            fixed = c.leak_host_min_bytes_per_step if host else c.leak_min_bytes_per_step
            if fixed is not None:
                out[spec.name] = float(fixed)
                continue
            floor = NOISE_FLOOR_BYTES.get(spec.kind, NOISE_FLOOR_BYTES["tensor_leak"])  # exact counters by default
            if host:
                floor = max(floor, RSS_BURST_BYTES / c.leak_window_steps)
            if spec.device not in headrooms:
                headrooms[spec.device] = self.headroom(spec)
            out[spec.name] = max(floor, self._material(headrooms[spec.device]))
        return out

    def _material(self, headroom: float | None) -> float:
        """The growth per step that would exhaust ``headroom`` within ``leak_horizon_hours`` at the
        measured step rate (0 until both are known)."""
        if headroom is None or not self.seconds_per_step:
            return 0.0
        return headroom * self.seconds_per_step / (self._options.leak_horizon_hours * 3600)

    def headroom(self, spec: SeriesSpec) -> float | None:
        """The memory a series' growth draws on: host RAM available, or what the device's allocator
        may still reserve plus what it caches beyond the step's peak."""
        # The newest of the sampler's reading and the newest fed step's, without building a state at
        # every evaluation: a state per CUDA device was a third of an evaluation under cProfile on the
        # CUDA-shaped path (benchmarks/bench_cuda_shaped.py --profile: 2.0 of 5.8 µs a step).
        published = self._agent.published
        if cuda_index(spec.device) is None:
            # The headroom under the binding host limit is the sampler's figure, less the RSS grown since.
            host = published.host
            if self._last_host is not None and self._last_host[0] >= published.updated_at:
                host = self._last_host[1]
            return float(host.available_bytes) if host is not None and host.available_bytes is not None else None
        allocator = published.allocator
        if self._last_allocator is not None and self._last_allocator[0] >= published.updated_at:
            allocator = self._last_allocator[1]
        nv = next((n for n in published.nvml if n.device == spec.device), None)
        a = next((s for s in allocator if s.device == spec.device), None)
        # What the allocator may still reserve: the driver's free memory, and under a per-process cap
        # (set_per_process_memory_fraction) no more than cap − reserved, however much the device has.
        reserved, cap = (a.reserved_bytes, a.cap_bytes) if a is not None else (None, None)
        reservable = reservable_bytes(nv.free_bytes if nv is not None else None, reserved, cap)
        if reservable is None:
            return None
        cached = 0
        if a is not None and a.reserved_bytes is not None:
            in_use = a.allocated_peak_bytes if a.allocated_peak_bytes is not None else a.allocated_bytes
            cached = max(0, a.reserved_bytes - (in_use or 0))
        # ... plus what the allocator caches beyond the step's peak
        return float(reservable + cached)

    def stated_rate(self, status: TrackStatus) -> float:
        """The growth per step a finding states. For a count series, the slope since its onset: the
        window's slope mixes in the flat steps before it (one tensor per step read "+0.91/step")."""
        slope = status.verdict.slope.slope
        if status.spec.unit == "bytes" or status.onset_step is None:
            return slope
        since = self._rate_since(status.spec.name, status)
        return since if since is not None and since > 0 else slope

    def host_rate(self, status: TrackStatus) -> float | None:
        """How fast host RSS grew since the onset of ``status`` (the CPU tensor finding that states it:
        ``leak_findings._host_claimant``), when that is material (above the host series' own
        threshold): the tensors a CPU leak keeps can cost the heap far more than their own bytes (each
        small one pins memory the allocator cannot give back: 256 B/step of tensors grew RSS by ~30
        KiB/step in a plain MLP loop, measured without the agent), and RSS is what runs out. None
        without an onset, or while RSS is flat.

        Material here means above what a slope over the whole episode can be fooled by: one burst of
        ``RSS_BURST_BYTES`` spread over it (the host series' window threshold at one window, less as
        the episode lasts), and what would exhaust the headroom within the horizon. The window's noise
        floor (16 KiB/step) made a finding whose warnings said "host RSS +45.1 KiB/step … out of memory
        in ~8.4 h" end with "~127 days", projected from its 4 B/step of tensors, once RSS's long-run
        rate fell to ~15 KiB/step."""
        if status.onset_step is None:
            return None
        rate = self._rate_since(self.host_spec.name, status)
        fixed = self._options.leak_host_min_bytes_per_step
        span = max(status.step - status.onset_step, self._options.leak_window_steps)
        floor = float(fixed) if fixed is not None else max(RSS_BURST_BYTES / span,
                                                           self._material(self.headroom(self.host_spec)))
        return rate if rate is not None and rate >= floor else None

    def _rate_since(self, name: str, status: TrackStatus) -> float | None:
        """Series ``name``'s slope since ``status``'s onset, worked out again at a state change, a new
        onset, and once the steps since the onset have doubled since the last time (a window at
        least): a Theil-Sen slope over every floor since the onset costs milliseconds, and a finding
        that lasts for days is evaluated every 50 steps, so its cost per step falls as the episode
        lasts. The slope over a long episode moves little between two of those: a stated rate is at
        most as old as the episode was when it was worked out."""
        onset = status.onset_step
        assert onset is not None
        key = (name, status.spec.name, status.phase)
        cached = self._rates.get(key)
        if (cached is None or status.changed or cached[0] != onset
                or status.step - cached[1] >= max(self._options.leak_window_steps, cached[1] - onset)):
            cached = self._rates[key] = (onset, status.step, self.detector.slope_since(name, status.phase, onset))
        return cached[2]

    def invisible_rate(self, status: TrackStatus) -> float | None:
        """How fast the device's allocated bytes the census cannot see (autograd-saved tensors) grew
        over the status's window; None off CUDA or without the points."""
        device = status.spec.device
        if cuda_index(device) is None:
            return None
        return self.detector.slope_since(series_name("invisible_bytes", device), status.phase, status.window_start)


def _deep_size(obj: object, depth: int = 4) -> int:
    """Sys.getsizeof of an object and what its fields and tuples hold (bounded depth): the memory
    one step record costs in the agent's ring buffer."""
    size = sys.getsizeof(obj)
    if depth <= 0:
        return size
    if isinstance(obj, (tuple, list)):
        return size + sum(_deep_size(v, depth - 1) for v in obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return size + sum(_deep_size(getattr(obj, f.name), depth - 1) for f in dataclasses.fields(obj))
    return size


