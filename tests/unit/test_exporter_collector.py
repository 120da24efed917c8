"""The collector: metric families from hand-built AgentStates (no agent, no server)."""

from __future__ import annotations

import dataclasses
import logging

import pytest
from fakes import ManualClock as _Clock
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gpumemd.exporter.collector import CounterBaseline, LiveFigures, StateCollector, StepClock, build_families
from gpumemd.exporter.metrics import BASE_LABELS, SPECS, reference_table
from gpumemd.probes.device.allocator import sample_from_stats
from gpumemd.records.census import Census, CensusGroup, GroupKey
from gpumemd.records.device import CPU, Device
from gpumemd.records.findings import Finding
from gpumemd.records.samples import (
    AllocatorSample,
    HostLimit,
    HostSample,
    NvmlDeviceSample,
    WorkerSample,
    WorkersSample,
)
from gpumemd.records.step import AgentState, Identity, Overhead, StepRecord
from gpumemd.records.step_profile import StepProfile

GiB = 1024**3


def torch_stats(allocated: int, reserved: int, *, retries: int = 0, ooms: int = 0) -> dict[str, int]:
    """A flattened ``torch.cuda.memory_stats()`` dict, keys as the native allocator writes them."""
    stats: dict[str, int] = {}
    for stat in ("allocation", "segment", "active", "inactive_split", "allocated_bytes", "reserved_bytes",
                 "active_bytes", "inactive_split_bytes", "requested_bytes"):
        for pool in ("all", "large_pool", "small_pool"):
            for kind in ("current", "peak", "allocated", "freed"):
                stats[f"{stat}.{pool}.{kind}"] = 0
    stats.update({
        "allocated_bytes.all.current": allocated, "allocated_bytes.all.peak": allocated + GiB,
        "reserved_bytes.all.current": reserved, "reserved_bytes.all.peak": reserved,
        "active_bytes.all.current": allocated + 4096, "inactive_split_bytes.all.current": 3 * 1024**2,
        "requested_bytes.all.current": allocated - 512, "segment.all.current": 7,
        "num_alloc_retries": retries, "num_ooms": ooms, "num_sync_all_streams": 0,
        "num_device_alloc": 40, "num_device_free": 2, "max_split_size": -1, "num_oom_rejections": 0,
    })
    return stats


def cuda_sample(device: int, allocated: int = 2 * GiB, reserved: int = 3 * GiB, **kw: int) -> AllocatorSample:
    sample = sample_from_stats(device, torch_stats(allocated, reserved, **kw))
    assert sample is not None
    return sample


def cuda_step_profile(step: int = 39) -> StepProfile:
    """A sampled CUDA step: every figure measured."""
    return StepProfile(
        step=step, device=Device.cuda(0), forward_start_bytes=2 * GiB, forward_peak_bytes=5 * GiB,
        after_backward_bytes=3 * GiB, after_step_bytes=2 * GiB + 1024, saved_for_backward_bytes=2 * GiB - 4096,
        saved_tensors=120, optimizer_step_peak_bytes=3 * GiB + 512, parameter_bytes=GiB,
        gradient_bytes=GiB, optimizer_state_bytes=2 * GiB,
    )


def full_state(n_devices: int = 2) -> AgentState:
    allocator = tuple(cuda_sample(d, retries=d) for d in range(n_devices))
    # device 0 runs under a per-process cap: set_per_process_memory_fraction(0.5) of its 80 GiB
    allocator = (dataclasses.replace(allocator[0], memory_fraction=0.5, cap_bytes=40 * GiB), *allocator[1:])
    census = Census(
        step=40, taken_at=1000.0, duration_s=0.02,
        groups=(
            CensusGroup(GroupKey(Device.cuda(0), "float32", (1024, 1024), "parameter", "fc.weight"), 1, 4 * 1024**2),
            CensusGroup(GroupKey(Device.cuda(0), "float32", (), "graph", None), 30, 120, graph_bytes=8 * 1024**2),
        ),
        invisible_bytes_by_device={Device.cuda(d): (d + 1) * 1024**2 for d in range(n_devices)},
    )
    finding = Finding(
        kind="tensor_leak", series="allocated_bytes{device=0}", state="confirmed",
        slope_bytes_per_step=1048576.0, slope_low=1e6, slope_high=1.1e6, onset_step=60,
        growth_bytes=50 * 1024**2, steps_to_oom=1234.0, first_step=100, updated_step=150,
        summary="allocated grows 1 MiB/step", device=Device.cuda(0),
    )
    # a DataLoader workers' finding and a growing tensor's: each growth with a figure of its own
    workers_finding = dataclasses.replace(finding, kind="host_leak", series="workers_rss_bytes",
                                          slope_bytes_per_step=300 * 1024.0, device=None)
    grown = dataclasses.replace(finding, series="growing_tensor_bytes{device=cuda:0,group=float32[N, 10]}",
                                slope_bytes_per_step=2560.0)
    record = StepRecord(step=41, wall_time=1001.0, duration_s=0.25, allocator=allocator)
    return AgentState(
        identity=Identity(rank=3, local_rank=1, world_size=8, hostname="node-a", pid=4242, source="torchrun"),
        attached_at=900.0, updated_at=1001.0, step=41, steps_total=42, last_step=record,
        allocator=allocator,
        nvml=tuple(NvmlDeviceSample(Device.cuda(d), 80 * GiB, 10 * GiB, 70 * GiB, 5 * GiB) for d in range(n_devices)),
        host=HostSample(rss_bytes=3 * GiB, available_bytes=100 * GiB, total_bytes=128 * GiB, pinned_bytes=GiB,
                        limit="ram", limits=(HostLimit("ram", 128 * GiB, 28 * GiB),
                                             HostLimit("cgroup", 256 * GiB, 20 * GiB)), file_bytes=GiB // 4),
        workers=WorkersSample((WorkerSample(5001, 2 * GiB, GiB // 2, GiB), WorkerSample(5002, 2 * GiB, GiB // 2, GiB))),
        census=census, censuses_total=2, findings=(finding, workers_finding, grown), reports=("/tmp/oom-1",),
        ooms_total=1,
        step_profile=cuda_step_profile(), ended="SIGTERM", ended_at=1_700_000_100.0,
        overhead=Overhead(training_thread_seconds_total=0.5, census_seconds_total=0.2,
                          sampler_seconds_total=0.1, wall_seconds=100.0, steps=42),
        probe_errors={"allocator": 0, "nvml": 2, "host": 0},
        probes_available={"allocator": True, "nvml": True, "host": True},
    )


# What a running agent adds at scrape time: with it, full_state() emits every catalogued metric.
FULL_LIVE = LiveFigures(seconds_per_step=0.2, phase="train")


def full_live() -> LiveFigures:
    return FULL_LIVE


def scrape(state: AgentState, baseline: CounterBaseline | None = None,
           live: LiveFigures | None = None) -> tuple[str, dict[str, list]]:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StateCollector(lambda: state, baseline, live=(lambda: live) if live else None))
    text = generate_latest(registry).decode()
    samples: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append(sample)
    return text, samples


def value(samples: dict[str, list], name: str, **labels: str) -> float:
    matches = [s.value for s in samples[name] if all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(matches) == 1, (name, labels, samples.get(name))
    return float(matches[0])


def test_every_catalogued_metric_is_emitted_from_a_full_state() -> None:
    text, samples = scrape(full_state(), live=FULL_LIVE)

    assert set(samples) == {spec.name for spec in SPECS}
    assert "_created" not in text


def test_names_follow_prometheus_conventions() -> None:
    _, samples = scrape(full_state(), live=FULL_LIVE)
    allowed = {*BASE_LABELS, "device", "category", "kind", "probe", "point", "version", "world_size", "hostname",
               "launcher", "job_phase", "stepping", "limit", "reason", "run_id"}
    for spec in SPECS:
        assert spec.name.startswith("gpumemd_")
        assert spec.name.endswith("_total") == (spec.type == "counter"), spec.name
        for sample in samples[spec.name]:
            assert set(sample.labels) <= allowed, (spec.name, sample.labels)
            assert sample.labels["rank"] == "3" and sample.labels["local_rank"] == "1"
    assert not any(label in {"step", "pid", "shape", "file"} for spec in SPECS for label in spec.labels)


def test_identity_is_one_info_metric() -> None:
    _, samples = scrape(full_state())

    [info] = samples["gpumemd_info"]
    assert info.value == 1
    assert info.labels["hostname"] == "node-a" and info.labels["launcher"] == "torchrun"
    assert info.labels["world_size"] == "8"
    assert "pid" not in info.labels
    # The run: pid and attach time (ms), on the identity and on the exit marker, so an alert joins them.
    assert info.labels["run_id"] == "4242-900000"
    [ended] = samples["gpumemd_agent_exit_timestamp_seconds"]
    assert ended.labels["run_id"] == "4242-900000" and ended.labels["reason"] == "SIGTERM"


def test_a_later_run_on_the_same_port_is_another_run() -> None:
    first, later = full_state(), dataclasses.replace(full_state(), attached_at=900.5)
    ids = {scrape(state)[1]["gpumemd_info"][0].labels["run_id"] for state in (first, later)}
    assert len(ids) == 2


def test_allocator_figures_come_from_pytorch_shaped_stats_per_device() -> None:
    _, samples = scrape(full_state(n_devices=8))

    assert len(samples["gpumemd_allocator_allocated_bytes"]) == 8
    assert value(samples, "gpumemd_allocator_allocated_bytes", device="5") == 2 * GiB
    assert value(samples, "gpumemd_allocator_reserved_bytes", device="5") == 3 * GiB
    assert value(samples, "gpumemd_allocator_active_bytes", device="0") == 2 * GiB + 4096
    assert value(samples, "gpumemd_allocator_inactive_split_bytes", device="0") == 3 * 1024**2
    assert value(samples, "gpumemd_allocator_peak_allocated_bytes", device="0") == 3 * GiB
    assert value(samples, "gpumemd_allocator_segments", device="0") == 7
    assert value(samples, "gpumemd_allocator_alloc_retries_total", device="5") == 5
    assert value(samples, "gpumemd_step_end_allocated_bytes", device="7") == 2 * GiB


def test_absent_probes_give_absent_metrics_not_zeros() -> None:
    state = AgentState(identity=Identity(), attached_at=1.0, updated_at=2.0)

    _, samples = scrape(state)

    for prefix in ("gpumemd_allocator_", "gpumemd_device_", "gpumemd_host_", "gpumemd_census_",
                   "gpumemd_leak_", "gpumemd_step_", "gpumemd_step_profile_"):
        assert not [name for name in samples if name.startswith(prefix)], prefix
    assert "gpumemd_step" not in samples  # no step yet
    # What is a real count is there from attach, at 0, so increase() sees the first event.
    for counter in ("gpumemd_steps_total", "gpumemd_ooms_total", "gpumemd_oom_reports_total",
                    "gpumemd_censuses_total"):
        assert value(samples, counter) == 0


def test_cuda_malloc_async_backend_exports_only_what_it_fills() -> None:
    sample = AllocatorSample(device=Device.cuda(0), allocated_bytes=GiB, reserved_bytes=2 * GiB, active_bytes=GiB)
    state = AgentState(identity=Identity(), attached_at=1.0, updated_at=2.0, allocator=(sample,))

    _, samples = scrape(state)

    allocator = {name for name in samples if name.startswith("gpumemd_allocator_")}
    assert allocator == {"gpumemd_allocator_allocated_bytes", "gpumemd_allocator_reserved_bytes",
                         "gpumemd_allocator_active_bytes"}


def test_process_usage_nvml_cannot_attribute_is_absent() -> None:
    nvml = (NvmlDeviceSample(Device.cuda(0), 80 * GiB, 10 * GiB, 70 * GiB, process_used_bytes=None),)
    state = AgentState(identity=Identity(), attached_at=1.0, updated_at=2.0, nvml=nvml)

    _, samples = scrape(state)

    assert "gpumemd_device_process_used_bytes" not in samples
    assert value(samples, "gpumemd_device_free_bytes", device="0") == 70 * GiB


def test_allocator_counters_start_at_zero_at_attach() -> None:
    at_attach = cuda_sample(0, retries=5, ooms=1)
    baseline = CounterBaseline([at_attach])
    later = AgentState(identity=Identity(), attached_at=1.0, updated_at=2.0,
                       allocator=(cuda_sample(0, retries=7, ooms=1), cuda_sample(1, retries=2)))

    _, samples = scrape(later, baseline)

    assert value(samples, "gpumemd_allocator_alloc_retries_total", device="0") == 2
    assert value(samples, "gpumemd_allocator_ooms_total", device="0") == 0
    assert value(samples, "gpumemd_allocator_alloc_retries_total", device="1") == 2  # first touched after attach


def test_a_reset_of_torch_counters_reads_as_a_counter_reset() -> None:
    baseline = CounterBaseline([cuda_sample(0, retries=5)])

    def retries(raw: int) -> float:
        sample = cuda_sample(0, retries=raw)
        state = AgentState(identity=Identity(), attached_at=1.0, updated_at=2.0, allocator=(sample,))
        return value(scrape(state, baseline)[1], "gpumemd_allocator_alloc_retries_total", device="0")

    assert retries(6) == 1
    assert retries(1) == 1  # reset_accumulated_memory_stats(): raw value from here on
    assert retries(9) == 9


def test_census_bytes_and_counts_per_category() -> None:
    _, samples = scrape(full_state())

    categories = {s.labels["category"] for s in samples["gpumemd_census_bytes"]}
    assert categories == {"parameter", "gradient", "optimizer_state", "buffer", "graph", "other"}
    assert value(samples, "gpumemd_census_bytes", category="parameter") == 4 * 1024**2
    assert value(samples, "gpumemd_census_bytes", category="graph") == 120 + 8 * 1024**2
    assert value(samples, "gpumemd_census_tensors", category="graph") == 30
    assert value(samples, "gpumemd_census_tensors", category="gradient") == 0
    assert value(samples, "gpumemd_censuses_total") == 2
    assert value(samples, "gpumemd_census_step") == 40  # how old the census series are, in steps and time
    assert value(samples, "gpumemd_census_timestamp_seconds") == 1000.0


def test_census_invisible_bytes_per_device_index() -> None:
    _, samples = scrape(full_state(n_devices=3))

    assert {s.labels["device"] for s in samples["gpumemd_census_invisible_bytes"]} == {"0", "1", "2"}
    assert value(samples, "gpumemd_census_invisible_bytes", device="2") == 3 * 1024**2


def test_a_cpu_census_has_no_invisible_bytes_series() -> None:
    census = Census(step=3, taken_at=1.0, duration_s=0.01,
                    groups=(CensusGroup(GroupKey(CPU, "float32", (8,), "parameter", "w"), 1, 32),))
    state = AgentState(identity=Identity(), attached_at=1.0, updated_at=2.0, census=census)

    _, samples = scrape(state)

    assert value(samples, "gpumemd_census_bytes", category="parameter") == 32
    assert "gpumemd_census_invisible_bytes" not in samples


def test_step_profile_bytes_one_series_per_measured_point() -> None:
    _, samples = scrape(full_state())

    profile = {s.labels["point"]: s.value for s in samples["gpumemd_step_profile_bytes"]}
    assert profile == {
        "forward_start": 2 * GiB, "forward_peak": 5 * GiB, "after_backward": 3 * GiB, "after_step": 2 * GiB + 1024,
        "optimizer_step_peak": 3 * GiB + 512, "saved_for_backward": 2 * GiB - 4096, "parameters": GiB,
        "gradients": GiB, "optimizer_state": 2 * GiB, "forward_transient": 3 * GiB,
        "optimizer_step_transient": 512,
    }
    assert value(samples, "gpumemd_step_profile_step") == 39


def test_cpu_step_profile_leaves_allocator_points_absent_not_zero() -> None:
    # On CPU the component measures saved-for-backward and the exact tensor terms, nothing else;
    # a zero saved_for_backward is a measurement (no graph), so it is exported.
    cpu = StepProfile(step=9, device=CPU, forward_start_bytes=None, forward_peak_bytes=None,
                      after_backward_bytes=None, after_step_bytes=None, saved_for_backward_bytes=0,
                      parameter_bytes=4096, gradient_bytes=4096, optimizer_state_bytes=None)
    state = AgentState(identity=Identity(), attached_at=1.0, updated_at=2.0, step_profile=cpu)

    _, samples = scrape(state)

    profile = {s.labels["point"]: s.value for s in samples["gpumemd_step_profile_bytes"]}
    assert profile == {"saved_for_backward": 0, "parameters": 4096, "gradients": 4096}
    assert value(samples, "gpumemd_step_profile_step") == 9


def _finding(kind: str, state: str, slope: float, device: Device | None, steps_to_oom: float | None = None) -> Finding:
    return Finding(kind=kind, series=f"s{device}", state=state, slope_bytes_per_step=slope, slope_low=slope,
                   slope_high=slope, onset_step=None, growth_bytes=int(slope * 10), steps_to_oom=steps_to_oom,
                   first_step=1, updated_step=2, summary="", device=device)


def test_findings_export_the_most_severe_per_kind_and_device() -> None:
    findings = (
        _finding("tensor_leak", "suspected", 5e6, Device.cuda(0), steps_to_oom=10.0),
        _finding("tensor_leak", "confirmed", 1e6, Device.cuda(0), steps_to_oom=900.0),
        _finding("host_leak", "cleared", 2e6, CPU),
    )
    state = AgentState(identity=Identity(), attached_at=1.0, updated_at=2.0, findings=findings)

    _, samples = scrape(state)

    assert value(samples, "gpumemd_leak_state", kind="tensor_leak", device="0") == 2
    assert value(samples, "gpumemd_leak_slope_bytes_per_step", kind="tensor_leak", device="0") == 1e6
    assert value(samples, "gpumemd_leak_steps_to_oom", kind="tensor_leak", device="0") == 900
    # A host finding is off CUDA: device="host".
    assert value(samples, "gpumemd_leak_state", kind="host_leak", device="host") == 0
    assert len(samples["gpumemd_leak_steps_to_oom"]) == 1  # None for host_leak: absent
    assert "gpumemd_leak_seconds_to_oom" not in samples  # no typical step time yet: no time


def test_time_to_oom_is_the_steps_at_the_typical_step_time() -> None:
    findings = (_finding("tensor_leak", "confirmed", 1e6, Device.cuda(0), steps_to_oom=900.0),
                _finding("host_leak", "suspected", 2e6, CPU, steps_to_oom=36000.0),
                _finding("graph_leak", "confirmed", 2e6, CPU))
    state = AgentState(identity=Identity(), attached_at=1.0, updated_at=2.0, findings=findings)

    _, samples = scrape(state, live=LiveFigures(seconds_per_step=0.2))

    assert value(samples, "gpumemd_leak_seconds_to_oom", kind="tensor_leak", device="0") == pytest.approx(180.0)
    assert value(samples, "gpumemd_leak_seconds_to_oom", kind="host_leak", device="host") == pytest.approx(7200.0)
    assert len(samples["gpumemd_leak_seconds_to_oom"]) == 2  # no steps-to-OOM figure for graph_leak: absent


def test_time_to_oom_is_the_findings_own_when_it_has_one() -> None:
    # the finding's time at its own step rate (what its line, the exit summary and gpumemd report say),
    # not its steps at another step time
    finding = dataclasses.replace(_finding("tensor_leak", "confirmed", 1e6, Device.cuda(0), steps_to_oom=900.0),
                                  hours_to_oom=0.25)
    state = AgentState(identity=Identity(), attached_at=1.0, updated_at=2.0, findings=(finding,))

    _, samples = scrape(state, live=LiveFigures(seconds_per_step=0.2))

    seconds = value(samples, "gpumemd_leak_seconds_to_oom", kind="tensor_leak", device="0")
    assert seconds == pytest.approx(finding.hours_to_oom * 3600) and seconds != pytest.approx(900.0 * 0.2)


def test_oom_reports_overhead_and_probe_errors() -> None:
    _, samples = scrape(full_state())

    assert value(samples, "gpumemd_ooms_total") == 1
    assert value(samples, "gpumemd_oom_reports_total") == 1
    # what the job paid: training thread and sampler thread, (0.5 + 0.1) s over 100 s
    assert value(samples, "gpumemd_agent_overhead_ratio") == pytest.approx(0.006)
    assert value(samples, "gpumemd_agent_census_seconds_total") == pytest.approx(0.2)
    assert value(samples, "gpumemd_probe_errors_total", probe="nvml") == 2
    assert value(samples, "gpumemd_probe_available", probe="host") == 1
    assert value(samples, "gpumemd_step_duration_seconds") == 0.25
    assert value(samples, "gpumemd_step") == 41
    assert value(samples, "gpumemd_steps_total") == 42


def test_a_failing_state_read_gives_an_empty_scrape_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    def broken() -> AgentState:
        raise RuntimeError("no state")

    collector = StateCollector(broken)
    with caplog.at_level(logging.WARNING, logger="gpumemd"):
        assert list(collector.collect()) == []
        assert list(collector.collect()) == []
    assert len([r for r in caplog.records if "building metrics failed" in r.getMessage()]) == 1


def test_build_families_has_no_duplicate_label_sets() -> None:
    for family in build_families(full_state(n_devices=8), live=FULL_LIVE):
        keys = [(s.name, tuple(sorted(s.labels.items()))) for s in family.samples]
        assert len(keys) == len(set(keys)), family.name


def test_reference_table_lists_every_metric() -> None:
    table = reference_table()
    for spec in SPECS:
        assert f"`{spec.name}`" in table


# --- step progress: what the stale alert reads ------------------------------------


def _stepped(steps_total: int, record_step: int, wall_time: float, phase: str = "train",
             duration: float | None = 0.5) -> AgentState:
    record = StepRecord(step=record_step, wall_time=wall_time, duration_s=duration, phase=phase)
    return AgentState(identity=Identity(), attached_at=1.0, updated_at=wall_time, step=steps_total - 1,
                      steps_total=steps_total, last_step=record, phase=phase)


def test_no_step_yet_means_no_last_step_timestamp_and_a_train_phase_without_steps() -> None:
    _, samples = scrape(AgentState(identity=Identity(), attached_at=1.0, updated_at=2.0))

    assert "gpumemd_last_step_timestamp_seconds" not in samples
    assert "gpumemd_step_typical_duration_seconds" not in samples  # not known before two sampled steps
    [phase] = samples["gpumemd_job_phase_info"]
    assert phase.value == 1 and phase.labels["job_phase"] == "train" and phase.labels["stepping"] == "false"


def test_last_step_timestamp_is_the_sampled_step_wall_time() -> None:
    _, samples = scrape(_stepped(steps_total=10, record_step=9, wall_time=1000.5), live=FULL_LIVE)

    assert value(samples, "gpumemd_last_step_timestamp_seconds") == 1000.5
    assert value(samples, "gpumemd_step_typical_duration_seconds") == 0.2
    assert value(samples, "gpumemd_job_phase_info", job_phase="train", stepping="true") == 1


def test_steps_counted_after_the_sampled_one_move_the_bound_to_the_previous_scrape() -> None:
    # Stride 10 set while steps were fast, then steps turned slow: the last record is steps old.
    clock = _Clock(2000.0)
    collector_clock = StepClock(clock)
    state = _stepped(steps_total=101, record_step=100, wall_time=1000.0)

    def last_step(state: AgentState) -> float | None:
        return collector_clock.last_step_at(state, collector_clock.now())

    assert last_step(state) == 1000.0  # first scrape: only the record's time is known
    clock.now = 2015.0
    assert last_step(state) == 1000.0  # same count: nothing new
    clock.now = 2030.0
    moved = _stepped(steps_total=104, record_step=100, wall_time=1000.0)  # 3 unsampled steps since
    assert last_step(moved) == 2015.0  # a step ended after the scrape at 2015 (lower bound, never later)
    clock.now = 2045.0
    assert last_step(moved) == 2015.0  # no new step: the bound stays
    clock.now = 2060.0
    sampled = _stepped(steps_total=105, record_step=104, wall_time=2050.0)
    assert last_step(sampled) == 2050.0  # a sampled step is exact


def test_an_overtaken_scrape_does_not_move_the_bound() -> None:
    step_clock = StepClock(_Clock(0.0))
    newer = _stepped(steps_total=6, record_step=5, wall_time=100.0)
    older = _stepped(steps_total=5, record_step=4, wall_time=90.0)
    assert step_clock.last_step_at(newer, read_at=120.0) == 100.0
    assert step_clock.last_step_at(older, read_at=110.0) == 90.0  # read before the newer one: says nothing
    assert step_clock.last_step_at(newer, read_at=130.0) == 100.0  # no bound was made up from it


def test_the_collector_feeds_its_step_clock_from_each_scrape() -> None:
    clock = _Clock(500.0)
    current = [_stepped(steps_total=3, record_step=2, wall_time=400.0)]
    collector = StateCollector(lambda: current[0], step_clock=StepClock(clock))
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)

    def exported() -> float:
        text = generate_latest(registry).decode()
        [sample] = [s for f in text_string_to_metric_families(text) for s in f.samples
                    if s.name == "gpumemd_last_step_timestamp_seconds"]
        return float(sample.value)

    assert exported() == 400.0
    clock.now = 515.0
    current[0] = _stepped(steps_total=9, record_step=2, wall_time=400.0)
    assert exported() == 500.0


def test_a_labelled_phase_without_steps_is_not_stepping() -> None:
    in_eval = LiveFigures(seconds_per_step=0.2, phase="eval")
    _, samples = scrape(_stepped(steps_total=10, record_step=9, wall_time=1000.0), live=in_eval)
    assert value(samples, "gpumemd_job_phase_info", job_phase="eval", stepping="false") == 1
    assert len(samples["gpumemd_job_phase_info"]) == 1

    # steps inside a labelled phase: the first one is always sampled, so the record carries the phase
    _, samples = scrape(_stepped(steps_total=10, record_step=9, wall_time=1000.0, phase="warmup"),
                        live=LiveFigures(phase="warmup"))
    assert value(samples, "gpumemd_job_phase_info", job_phase="warmup", stepping="true") == 1


def test_the_phase_label_is_bounded() -> None:
    _, samples = scrape(_stepped(steps_total=1, record_step=0, wall_time=1.0), live=LiveFigures(phase="x" * 500))
    [phase] = samples["gpumemd_job_phase_info"]
    assert phase.labels["job_phase"] == "x" * 64


def test_without_live_figures_the_phase_comes_from_the_state() -> None:
    _, samples = scrape(_stepped(steps_total=3, record_step=2, wall_time=1.0, phase="checkpoint"))
    assert value(samples, "gpumemd_job_phase_info", job_phase="checkpoint", stepping="true") == 1


def test_workers_memory_and_the_growths_with_figures_of_their_own_are_exported() -> None:
    def finding(series: str, kind: str, slope: float, state: str = "confirmed") -> Finding:
        return Finding(kind=kind, series=series, state=state, slope_bytes_per_step=slope, slope_low=slope,
                       slope_high=slope, onset_step=1, growth_bytes=1, steps_to_oom=None, first_step=1,
                       updated_step=2, summary="")
    state = dataclasses.replace(full_state(), findings=(
        finding("workers_rss_bytes", "host_leak", 600 * 1024.0),
        finding("growing_tensor_bytes{device=cpu,group=float32[N, 10]}", "tensor_leak", 2560.0),
        finding("growing_tensor_bytes{device=cpu,group=float32[N, 4]}", "tensor_leak", 9999.0, "cleared"),
    ))
    values = {(s.name, s.labels.get("kind", "")): s.value for m in build_families(state) for s in m.samples}
    devices = {s.labels["device"] for m in build_families(state) for s in m.samples
               if s.name == "gpumemd_leak_workers_slope_bytes_per_step"}
    assert devices == {"host"}  # off CUDA: as on gpumemd_leak_state, so the two join
    assert values[("gpumemd_workers", "")] == 2
    assert values[("gpumemd_workers_rss_bytes", "")] == 4 * GiB
    assert values[("gpumemd_workers_pss_bytes", "")] == 2 * GiB
    assert values[("gpumemd_workers_uss_bytes", "")] == GiB
    assert values[("gpumemd_leak_workers_slope_bytes_per_step", "host_leak")] == 600 * 1024
    assert values[("gpumemd_leak_growing_tensor_slope_bytes_per_step", "tensor_leak")] == 2560
