"""The catalogue of every metric the exporter emits: one place for names, types, labels and help.

The collector takes its help text from here, the README's reference table is rendered from here,
and the dashboard tests check that every metric a Grafana query names is in here *and* really
appears in an exposition. Pure data: no prometheus_client import.
"""

from __future__ import annotations

from dataclasses import dataclass

# Every series carries these, so dashboards can filter by rank without joining on gpumemd_info.
BASE_LABELS: tuple[str, ...] = ("rank", "local_rank")

LEAK_STATE_VALUES: dict[str, int] = {"cleared": 0, "suspected": 1, "confirmed": 2}


@dataclass(frozen=True, slots=True)
class MetricSpec:
    name: str
    type: str  # "gauge", "counter" or "info" (an info is a gauge of 1 with identity labels)
    labels: tuple[str, ...]  # beyond BASE_LABELS
    help: str
    source: str  # where the value comes from (for the README reference table)


def _g(name: str, labels: tuple[str, ...], help_: str, source: str) -> MetricSpec:
    return MetricSpec(name, "gauge", labels, help_, source)


def _c(name: str, labels: tuple[str, ...], help_: str, source: str) -> MetricSpec:
    return MetricSpec(name, "counter", labels, help_, source)


_D = ("device",)
HOST_DEVICE_LABEL = "host"
"""The ``device`` label of leak series off CUDA (host RSS, cpu tensors); CUDA devices are their ordinal."""

SPECS: tuple[MetricSpec, ...] = (
    MetricSpec(
        "gpumemd_info", "info", ("version", "world_size", "hostname", "launcher", "run_id"),
        "Identity of this gpumemd agent; always 1. run_id names this run of the job (pid and attach time in "
        "ms): a job started later on the same port has another.", "AgentState.identity, AgentState.attached_at",
    ),
    # --- CUDA caching allocator (torch.cuda.memory_stats), devices this rank touched ---
    _g("gpumemd_allocator_allocated_bytes", _D, "Bytes handed to live tensors by the CUDA caching allocator.",
       "memory_stats allocated_bytes.all.current (latest sample)"),
    _g("gpumemd_allocator_reserved_bytes", _D, "Bytes the caching allocator holds from the driver (used + cached).",
       "memory_stats reserved_bytes.all.current"),
    _g("gpumemd_allocator_active_bytes", _D, "Bytes in active blocks (allocated, or freed but pending on a stream).",
       "memory_stats active_bytes.all.current"),
    _g("gpumemd_allocator_inactive_split_bytes", _D,
       "Bytes in inactive split blocks: fragmentation empty_cache() cannot release. Absent under "
       "expandable_segments:True and cudaMallocAsync, where torch does not maintain it (it reads 0).",
       "memory_stats inactive_split_bytes.all.current"),
    _g("gpumemd_allocator_requested_bytes", _D, "Bytes requested by callers before the allocator's rounding.",
       "memory_stats requested_bytes.all.current"),
    _g("gpumemd_allocator_peak_allocated_bytes", _D,
       "Peak allocated bytes since the last peak reset (per step with reset_peak_each_step).",
       "memory_stats allocated_bytes.all.peak"),
    _g("gpumemd_allocator_peak_reserved_bytes", _D, "Peak reserved bytes since the last peak reset.",
       "memory_stats reserved_bytes.all.peak"),
    _g("gpumemd_allocator_segments", _D, "Segments (cudaMalloc'd or mapped regions) the allocator holds.",
       "memory_stats segment.all.current"),
    _g("gpumemd_allocator_cap_bytes", _D,
       "The per-process cap on reserved bytes (set_per_process_memory_fraction x device total); absent when "
       "none is set. Under it the allocator can reserve min(device free, cap - reserved) more.",
       "torch.cuda.get_per_process_memory_fraction, get_device_properties().total_memory"),
    _c("gpumemd_allocator_alloc_retries_total", _D,
       "cudaMalloc failures the allocator answered by flushing its cache and retrying, since attach.",
       "memory_stats num_alloc_retries minus its value at attach"),
    _c("gpumemd_allocator_ooms_total", _D, "Out-of-memory errors raised by the CUDA allocator since attach.",
       "memory_stats num_ooms minus its value at attach"),
    _c("gpumemd_allocator_oom_rejections_total", _D,
       "Allocations the allocator refused up front, before asking the driver, because they would pass the "
       "per-process cap (throw_on_cudamalloc_oom with a memory fraction; torch 2.13+), since attach. Each is "
       "an OutOfMemoryError the job saw.",
       "memory_stats num_oom_rejections minus its value at attach"),
    _c("gpumemd_allocator_device_allocs_total", _D, "cudaMalloc/cuMemMap calls made by the allocator since attach.",
       "memory_stats num_device_alloc minus its value at attach"),
    _c("gpumemd_allocator_device_frees_total", _D, "cudaFree/cuMemUnmap calls made by the allocator since attach.",
       "memory_stats num_device_free minus its value at attach"),
    _g("gpumemd_step_end_allocated_bytes", _D,
       "Allocated bytes at the last step end (after optimizer.step()): the job's baseline, the leak signal.",
       "StepRecord.allocator of the last step"),
    # --- the driver's view (NVML; creates no CUDA context) ---
    _g("gpumemd_device_total_bytes", _D, "Total memory of the device, as NVML reports it.", "NVML memory info"),
    _g("gpumemd_device_used_bytes", _D, "Memory in use on the device by every process, as NVML reports it.",
       "NVML memory info"),
    _g("gpumemd_device_free_bytes", _D,
       "Free memory on the device, as NVML reports it (device-wide: under a per-process cap the job's "
       "headroom is min(this, gpumemd_allocator_cap_bytes - reserved)).", "NVML memory info"),
    _g("gpumemd_device_process_used_bytes", _D,
       "Device memory NVML attributes to this process (absent when NVML cannot see the pid, e.g. containers).",
       "NVML running compute processes"),
    # --- host ---
    _g("gpumemd_host_rss_bytes", (), "Resident set size of this process.", "/proc/self/statm or psutil"),
    _g("gpumemd_host_available_bytes", (),
       "Memory this process can still allocate: the least headroom of the host's available RAM, its cgroup's "
       "memory limit less the cgroup's working set, and RLIMIT_AS / RLIMIT_DATA less the process's size "
       "(gpumemd_host_limit_headroom_bytes per limit).",
       "psutil.virtual_memory().available; memory.max - memory.current + inactive_file (cgroup v2) or v1's "
       "memory.limit_in_bytes; getrlimit and /proc/self/statm"),
    _g("gpumemd_host_total_bytes", (),
       "Size of the memory limit that binds (the one gpumemd_host_available_bytes is the headroom of): the "
       "host's RAM, or the cgroup limit or rlimit when it leaves less room.",
       "psutil.virtual_memory().total, or the limit"),
    _g("gpumemd_host_limit_bytes", ("limit",),
       "Each memory limit found: limit=\"ram\" (the host's RAM), \"cgroup\" (the tightest memory limit of "
       "this process's cgroup and its parents), \"rlimit_as\", \"rlimit_data\" (soft limits).",
       "psutil, the cgroup's memory files, getrlimit"),
    _g("gpumemd_host_limit_headroom_bytes", ("limit",),
       "Headroom under each memory limit found; the least is gpumemd_host_available_bytes.",
       "limit - its use (RAM in use, cgroup working set, virtual or data size)"),
    _g("gpumemd_host_pinned_bytes", (), "Pinned host memory held by torch's caching host allocator.",
       "torch.cuda.host_memory_stats()"),
    _g("gpumemd_host_file_bytes", (),
       "Of gpumemd_host_rss_bytes, the pages mapped from files and shared memory: a memory-mapped dataset's page "
       "cache, which the kernel takes back when memory runs short (the leak detector leaves it out).",
       "/proc/self/statm (shared) or psutil"),
    _g("gpumemd_workers", (), "The job's child processes (DataLoader workers and any other children) seen at the "
       "last reading.", "/proc/self/task/*/children or psutil"),
    _g("gpumemd_workers_rss_bytes", (),
       "Resident set size of the job's child processes, summed (counts the pages they share with this process "
       "once per worker).", "/proc/<pid>/statm or psutil"),
    _g("gpumemd_workers_pss_bytes", (),
       "Proportional set size of the job's child processes, summed: what they add to the host's use, shared "
       "pages split (absent where the kernel does not give it).", "/proc/<pid>/smaps_rollup or psutil"),
    _g("gpumemd_workers_uss_bytes", (),
       "Pages only the job's child processes hold, summed: where a Dataset's copy-on-read and caches show.",
       "/proc/<pid>/smaps_rollup or psutil"),
    # --- steps ---
    _g("gpumemd_step", (), "Number of the last completed training step.", "AgentState.step"),
    _c("gpumemd_steps_total", (), "Training steps completed since attach.", "AgentState.steps_total"),
    _g("gpumemd_step_duration_seconds", (), "Wall time of the last training step.", "StepRecord.duration_s"),
    _g("gpumemd_last_step_timestamp_seconds", (),
       "Unix time the last training step ended, as a lower bound: the wall time of the last sampled step, "
       "moved later once a scrape has seen steps counted since; exact to within the sampling stride (at most "
       "10 steps, 40 while a leak is only tracked; on fast steps only). Absent before the first step. "
       "The stale alert reads it.",
       "StepRecord.wall_time; the scrapes' step counts"),
    _g("gpumemd_step_typical_duration_seconds", (),
       "Typical wall time of one training step: the median over the last sampled steps, so a pause between "
       "steps (an evaluation, a checkpoint) does not move it. Absent before two sampled steps.",
       "Agent.seconds_per_step"),
    MetricSpec(
        "gpumemd_job_phase_info", "info", ("job_phase", "stepping"),
        "The phase the training process is in now, as labelled with gpumemd.phase(...) ('train' outside any; "
        "at most 64 characters), and whether a training step has ended in it (stepping 'true'/'false'); "
        "always 1, one series.",
        "Agent.current_phase; StepRecord.phase of the last step",
    ),
    # --- tensor census ---
    _g("gpumemd_census_bytes", ("category",),
       "Bytes of live tensors by category in the last census (graph: bytes kept alive by autograd graphs).",
       "Census.bytes_by_category()"),
    _g("gpumemd_census_tensors", ("category",), "Live tensor storages by category in the last census.",
       "Census.count_by_category()"),
    _g("gpumemd_census_duration_seconds", (), "Wall time the last census took.", "Census.duration_s"),
    _g("gpumemd_census_step", (),
       "Training step of the last census: gpumemd_census_bytes and _tensors are as of this step "
       "(compare with gpumemd_step).", "Census.step"),
    _g("gpumemd_census_timestamp_seconds", (),
       "Unix time the last census was taken: time() - this is how old the census series are.", "Census.taken_at"),
    _c("gpumemd_censuses_total", (), "Tensor censuses taken since attach.", "AgentState.censuses_total"),
    _g("gpumemd_census_invisible_bytes", _D,
       "CUDA allocated bytes the last census could not see as live tensors (mostly activations saved for "
       "backward); absent on CPU.", "Census.invisible_bytes_by_device"),
    # --- step profile (attach(step_profile=True); one sampled step in step_profile_every_steps) ---
    _g("gpumemd_step_profile_bytes", ("point",),
       "Bytes at each point of the last profiled training step (forward_start, forward_peak, after_backward, "
       "after_step, optimizer_step_peak, saved_for_backward, parameters, gradients, optimizer_state, "
       "forward_transient, optimizer_step_transient); the allocator's points are absent on CPU.",
       "StepProfile.figures()"),
    _g("gpumemd_step_profile_step", (), "Training step the last step profile was measured on.", "StepProfile.step"),
    # --- leak findings (one series per finding kind and device: the most severe finding) ---
    _g("gpumemd_leak_state", ("kind", "device"), "Leak finding state: 0 cleared, 1 suspected, 2 confirmed.",
       "Finding.state"),
    _g("gpumemd_leak_slope_bytes_per_step", ("kind", "device"),
       "Robust (Theil-Sen) growth of the leaking series, in bytes per step.", "Finding.slope_bytes_per_step"),
    _g("gpumemd_leak_growth_bytes", ("kind", "device"), "Bytes the leaking series grew since the onset.",
       "Finding.growth_bytes"),
    _g("gpumemd_leak_steps_to_oom", ("kind", "device"),
       "Steps until out-of-memory at the current slope, or at host RSS's growth for a CPU tensor finding "
       "that states it (absent when there is no headroom figure).",
       "Finding.steps_to_oom"),
    _g("gpumemd_leak_seconds_to_oom", ("kind", "device"),
       "Seconds until out-of-memory at the current slope (or host RSS's growth, as steps_to_oom): the "
       "finding's own time to OOM, as its line, the exit summary and gpumemd report say it (else its steps "
       "at the job's typical step time; absent without either).",
       "Finding.hours_to_oom x 3600, else Finding.steps_to_oom x Agent.seconds_per_step"),
    _g("gpumemd_leak_workers_slope_bytes_per_step", ("kind", "device"),
       "Growth per step of the job's child processes (DataLoader workers) when a leak finding is on them, "
       "all of them together.", "Finding.slope_bytes_per_step of the workers_rss_bytes series"),
    _g("gpumemd_leak_growing_tensor_slope_bytes_per_step", ("kind", "device"),
       "Growth per step of a tensor replaced each step by a larger one (torch.cat onto a kept tensor), the "
       "fastest when several grow.", "Finding.slope_bytes_per_step of a growing_tensor_bytes series"),
    # --- OOM post-mortems ---
    _c("gpumemd_ooms_total", (), "Out-of-memory errors since attach: those that propagated and those the job caught.",
       "AgentState.ooms_total"),
    _c("gpumemd_oom_reports_total", (), "OOM post-mortem directories written since attach.",
       "len(AgentState.reports)"),
    # --- the agent itself ---
    _c("gpumemd_agent_training_thread_seconds_total", (),
       "Seconds the agent spent on the training thread since attach (censuses included).",
       "Overhead.training_thread_seconds_total"),
    _c("gpumemd_agent_census_seconds_total", (), "Seconds spent in tensor censuses since attach.",
       "Overhead.census_seconds_total"),
    _c("gpumemd_agent_sampler_seconds_total", (), "Seconds the background sampler thread spent since attach.",
       "Overhead.sampler_seconds_total"),
    _g("gpumemd_agent_overhead_ratio", (),
       "Share of wall time the agent took from the job: training thread and sampler (0..1).", "Overhead.ratio"),
    _g("gpumemd_agent_last_update_timestamp_seconds", (), "Unix time of the agent's last published state.",
       "AgentState.updated_at"),
    _g("gpumemd_agent_start_timestamp_seconds", (), "Unix time the agent was attached.", "AgentState.attached_at"),
    _g("gpumemd_agent_exit_timestamp_seconds", ("reason", "run_id"),
       "Unix time the agent recorded the job's end: reason 'exit:N' (exit status N, under gpumemd run), "
       "'exit' (detach, or an exit under attach() without an uncaught exception: python does not tell its "
       "status), the signal that ended the job ('SIGTERM', 'SIGINT' also for "
       "an uncaught KeyboardInterrupt, 'SIGUSR1', 'SIGUSR2'), 'oom' (an uncaught out-of-memory error ends the "
       "process) or 'exception:T' (another uncaught exception, of type T). run_id as in gpumemd_info. Absent "
       "while the job runs; in the last scrape, push and textfile. A target gone without it vanished (SIGKILL, "
       "the OOM killer).",
       "AgentState.ended, AgentState.ended_at"),
    _c("gpumemd_probe_errors_total", ("probe",), "Failed reads per probe since attach (logged once per kind).",
       "AgentState.probe_errors"),
    _g("gpumemd_probe_available", ("probe",), "1 when the probe can read on this machine, 0 when it is absent.",
       "AgentState.probes_available"),
)

BY_NAME: dict[str, MetricSpec] = {spec.name: spec for spec in SPECS}


def reference_table() -> str:
    """The README's metric reference, as a Markdown table."""
    rows = ["| metric | type | labels | meaning | source |", "|---|---|---|---|---|"]
    for spec in SPECS:
        labels = ", ".join(f"`{label}`" for label in (*BASE_LABELS, *spec.labels))
        rows.append(f"| `{spec.name}` | {spec.type} | {labels} | {spec.help} | {spec.source} |")
    return "\n".join(rows)
