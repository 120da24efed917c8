"""Generate grafana/dashboards/gpumemd.json (run: python grafana/generate_dashboard.py).

The JSON is the artifact Grafana loads; this script is how it is edited, so panels stay uniform
(datasource variable, job/instance/rank matchers, units, descriptions, grid). A test checks the
committed JSON is what this script produces.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

OUT = Path(__file__).resolve().parent / "dashboards" / "gpumemd.json"
DS = {"type": "prometheus", "uid": "${datasource}"}

# Matchers every query carries (dashboard-linter: target-job-rule, target-instance-rule). training_job is
# a target label (file_sd, the Slurm helper, the PodMonitor); its "All" is ".*", which also takes targets
# without it.
SEL = 'job=~"$job", training_job=~"$training_job", instance=~"$instance", rank=~"$rank"'
SEL_DEV = SEL + ', device=~"$device"'


def sel(metric: str, device: bool = False, extra: str = "") -> str:
    matchers = SEL_DEV if device else SEL
    return f"{metric}{{{matchers}{', ' + extra if extra else ''}}}"


def no_device(host_metric: str, device_metric: str) -> str:
    """``host_metric`` of the ranks that export no ``device_metric``: CPU jobs, where the device panels
    would otherwise stay empty."""
    return f"{sel(host_metric)} unless on (job, instance, rank) {sel(device_metric)}"


class Layout:
    """Places panels on Grafana's 24-column grid, row by row."""

    def __init__(self) -> None:
        self.panels: list[dict[str, Any]] = []
        self.y = 0
        self.x = 0
        self.row_h = 0
        self.next_id = 1

    def _id(self) -> int:
        self.next_id += 1
        return self.next_id - 1

    def row(self, title: str) -> None:
        self._newline()
        self.panels.append(
            {"type": "row", "id": self._id(), "title": title, "collapsed": False,
             "gridPos": {"h": 1, "w": 24, "x": 0, "y": self.y}, "panels": []}
        )
        self.y += 1

    def _newline(self) -> None:
        if self.x:
            self.y += self.row_h
            self.x = 0
            self.row_h = 0

    def add(self, panel: dict[str, Any], w: int, h: int = 8) -> None:
        if self.x + w > 24:
            self._newline()
        panel["id"] = self._id()
        panel["gridPos"] = {"h": h, "w": w, "x": self.x, "y": self.y}
        self.panels.append(panel)
        self.x += w
        self.row_h = max(self.row_h, h)


def targets(*queries: tuple[str, str]) -> list[dict[str, Any]]:
    return [
        {"datasource": DS, "expr": expr, "legendFormat": legend, "refId": chr(ord("A") + i)}
        for i, (expr, legend) in enumerate(queries)
    ]


NO_CUDA = "No CUDA device in this job"
"""What a CUDA-only panel says on a job without one, in place of Grafana's "No data"."""


def timeseries(title: str, description: str, unit: str, *queries: tuple[str, str],
               stack: bool = False, decimals: int | None = None, axis_label: str | None = None,
               no_value: str | None = None) -> dict[str, Any]:
    defaults: dict[str, Any] = {
        "unit": unit,
        "custom": {"fillOpacity": 30 if stack else 10, "stacking": {"mode": "normal" if stack else "none"}},
    }
    if no_value is not None:
        defaults["noValue"] = no_value
    if axis_label is not None:
        defaults["custom"]["axisLabel"] = axis_label
    if decimals is not None:
        defaults["decimals"] = decimals
    return {
        "type": "timeseries", "title": title, "description": description, "datasource": DS,
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "options": {"legend": {"displayMode": "list", "placement": "bottom"}, "tooltip": {"mode": "multi"}},
        "targets": targets(*queries),
    }


def stat(title: str, description: str, unit: str, *queries: tuple[str, str],
         mappings: list[dict[str, Any]] | None = None, thresholds: list[tuple[float | None, str]] | None = None
         ) -> dict[str, Any]:
    steps = [{"color": color, "value": value} for value, color in (thresholds or [(None, "green")])]
    return {
        "type": "stat", "title": title, "description": description, "datasource": DS,
        "fieldConfig": {"defaults": {"unit": unit, "mappings": mappings or [],
                                     "thresholds": {"mode": "absolute", "steps": steps}}, "overrides": []},
        "options": {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
                    "colorMode": "background", "graphMode": "none", "textMode": "auto"},
        "targets": targets(*queries),
    }


# 0: no finding, or the last one cleared (growth stopped); the Leak state query turns "no finding" into 0.
LEAK_MAPPINGS = [{"type": "value", "options": {
    "0": {"text": "healthy", "color": "green"},
    "1": {"text": "suspected", "color": "orange"},
    "2": {"text": "confirmed", "color": "red"},
}}]

# Firing gpumemd alerts as annotations on every time panel. No rank matcher: GpumemdAgentDown has none.
ALERT_ANNOTATIONS = {
    "name": "gpumemd alerts", "datasource": DS, "enable": True, "hide": False, "iconColor": "red",
    "expr": 'ALERTS{alertname=~"Gpumemd.*", alertstate="firing", job=~"$job", training_job=~"$training_job", '
            'instance=~"$instance"}',
    "step": "1m", "titleFormat": "{{alertname}} ({{severity}})",
    "textFormat": "{{instance}} rank {{rank}} {{kind}} {{device}}", "tagKeys": "severity,rank",
    "useValueForTime": False,
}
BUILTIN_ANNOTATIONS = {
    "builtIn": 1, "datasource": {"type": "grafana", "uid": "-- Grafana --"}, "enable": True, "hide": True,
    "iconColor": "rgba(0, 211, 255, 1)", "name": "Annotations & Alerts", "type": "dashboard",
}

DEV = "{{instance}} r{{rank}} cuda:{{device}}"
INST = "{{instance}} r{{rank}}"


def build() -> dict[str, Any]:
    g = Layout()
    g.row("Overview")
    free = sel("gpumemd_device_free_bytes", device=True)
    # Under a per-process cap (set_per_process_memory_fraction) the allocator may reserve no more than
    # cap - reserved, whatever the device has free: min(free, cap - reserved), in PromQL's filter-or form.
    under_cap = (f"clamp_min({sel('gpumemd_allocator_cap_bytes', device=True)}"
                 f" - {sel('gpumemd_allocator_reserved_bytes', device=True)}, 0)")
    g.add(stat(
        "Device headroom", "Memory this rank can still allocate on each GPU: NVML's free memory plus the "
        "caching allocator's cache (reserved - allocated), which PyTorch reuses before it asks the driver. "
        "NVML alone counts that cache as used and shows a full device for a healthy job. Under a per-process "
        "cap (set_per_process_memory_fraction) the free part is at most cap - reserved. Where the allocator "
        "is not read yet (CUDA not initialised), NVML's free memory. Below a few GiB, the next larger batch "
        "or a new shape can run out of memory. On a rank with no GPU, the host's headroom under its binding "
        "limit (RAM, cgroup, rlimit) instead.", "bytes",
        (f"((({free} < {under_cap}) or {under_cap} or {free})"
         f" + {sel('gpumemd_allocator_reserved_bytes', device=True)}"
         f" - {sel('gpumemd_allocator_allocated_bytes', device=True)})"
         f" or {free}", DEV),
        (no_device("gpumemd_host_available_bytes", "gpumemd_device_free_bytes"), INST + " host (no GPU)"),
        thresholds=[(None, "red"), (2 * 1024**3, "orange"), (8 * 1024**3, "green")]), w=6)
    g.add(stat(
        "Host memory available", "Memory the host still has for new allocations (DataLoader workers, "
        "pinned buffers, the Python heap).", "bytes", (sel("gpumemd_host_available_bytes"), INST),
        thresholds=[(None, "red"), (4 * 1024**3, "orange"), (16 * 1024**3, "green")]), w=6)
    g.add(stat(
        "Leak state", "The agent's leak finding per kind: suspected after one window of steady growth, "
        "confirmed after a long window (alert GpumemdLeakConfirmed). Healthy: no finding, or the last one "
        "cleared (growth stopped).", "none",
        (f"max by (instance, rank, kind) ({sel('gpumemd_leak_state')}) "
         f"or on (instance, rank) max by (instance, rank) (0 * {sel('gpumemd_info')})",
         "{{instance}} r{{rank}} {{kind}}"),
        mappings=LEAK_MAPPINGS), w=6)
    g.add(stat(
        "Out-of-memory errors", "OOM errors the agent saw since attach, and post-mortem reports written "
        "(one directory each in the agent's output directory).", "short",
        (sel("gpumemd_ooms_total"), INST + " OOMs"), (sel("gpumemd_oom_reports_total"), INST + " reports"),
        thresholds=[(None, "green"), (1, "red")]), w=6)
    g.add(timeseries(
        "Memory at step end vs the device", "Allocated bytes after optimizer.step() (the job's baseline: "
        "a steady rise is a leak), the allocator's reserved bytes, NVML's used and total for the device, and "
        "the per-process cap on reserved bytes when the job set one (set_per_process_memory_fraction). On a "
        "rank with no GPU, the process's RSS against the host limit that binds (RAM, cgroup or rlimit).",
        "bytes",
        (sel("gpumemd_step_end_allocated_bytes", device=True), DEV + " step-end allocated"),
        (sel("gpumemd_allocator_reserved_bytes", device=True), DEV + " reserved"),
        (sel("gpumemd_device_used_bytes", device=True), DEV + " NVML used"),
        (sel("gpumemd_device_total_bytes", device=True), DEV + " total"),
        (sel("gpumemd_allocator_cap_bytes", device=True), DEV + " process cap"),
        (no_device("gpumemd_host_rss_bytes", "gpumemd_device_total_bytes"), INST + " host RSS (no GPU)"),
        (no_device("gpumemd_host_total_bytes", "gpumemd_device_total_bytes"), INST + " host limit (no GPU)")), w=12)
    # Grafana has no "bytes per step" unit (a custom unit such as "suffix:B/step" loses the KiB/MiB
    # scaling): IEC bytes, with "per step" on the axis and in each series' name.
    g.add(timeseries(
        "Leak slope", "Robust (Theil-Sen) growth of each leaking series in bytes per training step "
        "(per step, not per second), from the agent's finding.", "bytes",
        (sel("gpumemd_leak_slope_bytes_per_step"), "{{instance}} r{{rank}} {{kind}} {{device}} per step"),
        axis_label="per training step"), w=6)
    g.add(timeseries(
        "Projected time to OOM", "Time left before out-of-memory at the current leak slope and the job's "
        "typical step time (headroom / slope x median step time: gpumemd_leak_seconds_to_oom), for every "
        "live finding. Alert GpumemdOOMProjected pages under 1 hour at once, under 6 hours once it has held "
        "5 minutes.", "s",
        (f"{sel('gpumemd_leak_seconds_to_oom')} and {sel('gpumemd_leak_state')} > 0",
         "{{instance}} r{{rank}} {{kind}} {{device}}"),
        no_value="No live leak finding"), w=6)

    g.row("Allocator (CUDA)")
    g.add(timeseries(
        "Allocated, active and reserved", "The CUDA caching allocator: bytes in live tensors (allocated), "
        "in active blocks, and held from the driver (reserved = allocated + cache).", "bytes",
        (sel("gpumemd_allocator_allocated_bytes", device=True), DEV + " allocated"),
        (sel("gpumemd_allocator_active_bytes", device=True), DEV + " active"),
        (sel("gpumemd_allocator_reserved_bytes", device=True), DEV + " reserved"), no_value=NO_CUDA), w=12)
    g.add(timeseries(
        "Peak allocated vs step end", "Peak allocated bytes (per step when reset_peak_each_step is on) "
        "against the step-end baseline: the gap is activations and temporaries, the OOM risk.", "bytes",
        (sel("gpumemd_allocator_peak_allocated_bytes", device=True), DEV + " peak"),
        (sel("gpumemd_step_end_allocated_bytes", device=True), DEV + " step end"),
        (sel("gpumemd_allocator_requested_bytes", device=True), DEV + " requested"), no_value=NO_CUDA), w=12)
    g.add(timeseries(
        "Allocator retries and OOMs", "cudaMalloc failures answered by flushing the cache and retrying, "
        "and allocator OOMs, per second. Any retries mean the job is at the edge of its memory. Rejections: "
        "allocations refused up front under the process cap (throw_on_cudamalloc_oom).", "ops",
        (f"rate({sel('gpumemd_allocator_alloc_retries_total', device=True)}[$__rate_interval])", DEV + " retries"),
        (f"rate({sel('gpumemd_allocator_ooms_total', device=True)}[$__rate_interval])", DEV + " OOMs"),
        (f"rate({sel('gpumemd_allocator_oom_rejections_total', device=True)}[$__rate_interval])",
         DEV + " rejections"), no_value=NO_CUDA), w=12)
    g.add(timeseries(
        "cudaMalloc and cudaFree calls", "Calls the allocator makes to the driver per second; a steady "
        "rate after warm-up means the cache thrashes (empty_cache() in the loop, or fragmentation).", "ops",
        (f"rate({sel('gpumemd_allocator_device_allocs_total', device=True)}[$__rate_interval])", DEV + " malloc"),
        (f"rate({sel('gpumemd_allocator_device_frees_total', device=True)}[$__rate_interval])", DEV + " free"),
        no_value=NO_CUDA), w=12)

    g.row("Fragmentation (CUDA)")
    g.add(timeseries(
        "Fragmentation ratio", "Inactive split bytes over reserved bytes: cache that empty_cache() cannot "
        "release (alert GpumemdFragmentationHigh above 30%). No data under expandable_segments:True or "
        "cudaMallocAsync: torch does not maintain inactive split bytes there.", "percentunit",
        (f"{sel('gpumemd_allocator_inactive_split_bytes', device=True)} / "
         f"({sel('gpumemd_allocator_reserved_bytes', device=True)} > 0)", DEV),
        no_value=NO_CUDA + ", or expandable_segments / cudaMallocAsync (no split blocks)"), w=8)
    g.add(timeseries(
        "Cache: free and split", "Reserved minus allocated (the allocator's cache, which NVML-only tools "
        "mistake for use) and the inactive split part of it.", "bytes",
        (f"{sel('gpumemd_allocator_reserved_bytes', device=True)} - "
         f"{sel('gpumemd_allocator_allocated_bytes', device=True)}", DEV + " cached free"),
        (sel("gpumemd_allocator_inactive_split_bytes", device=True), DEV + " inactive split"), no_value=NO_CUDA), w=8)
    g.add(timeseries(
        "Memory outside PyTorch", "Device memory NVML attributes to this process minus what PyTorch's "
        "allocator reserved: CUDA context, NCCL, cuBLAS/cuDNN workspaces (alert GpumemdNonPyTorchMemoryGrowing).",
        "bytes",
        (f"{sel('gpumemd_device_process_used_bytes', device=True)} - "
         f"{sel('gpumemd_allocator_reserved_bytes', device=True)}", DEV),
        no_value=NO_CUDA + ", or NVML cannot see this process"), w=8)

    g.row("Census by category")
    g.add(timeseries(
        "Tensor bytes by category", "Live tensors in the last census, by what they are: parameters, "
        "gradients, optimizer state, buffers, autograd graphs kept alive, other.", "bytes",
        (f"sum by (category) ({sel('gpumemd_census_bytes')})", "{{category}}"), stack=True), w=12)
    g.add(timeseries(
        "Tensor count by category", "Live tensor storages in the last census by category; a count that "
        "grows every step names the kind of tensor that leaks.", "short",
        (f"sum by (category) ({sel('gpumemd_census_tensors')})", "{{category}}"), stack=True), w=12)

    g.row("Step profile")
    g.add(timeseries(
        "Memory by step profile point", "One sampled step in step_profile_every_steps, point by point (only with "
        "attach(step_profile=True)): allocated bytes at forward start, forward peak, after backward, after "
        "optimizer.step() and its peak (CUDA only), bytes saved for backward (activations), and the exact "
        "parameter, gradient and optimizer-state bytes. The forward peak is where an OOM usually strikes.",
        "bytes", (sel("gpumemd_step_profile_bytes"), INST + " {{point}}"),
        no_value="Off: attach(step_profile=True) turns it on"), w=24)

    g.row("Host")
    g.add(timeseries(
        "Trainer and workers", "Host memory of the training process (its resident set) and of its child "
        "processes, DataLoader workers included (their proportional share, PSS, which splits the pages they "
        "share with the trainer; their RSS where the kernel gives no PSS), stacked: what the job takes from "
        "the host. A workers' band that keeps rising while the trainer stays flat is a Dataset cache or "
        "copy-on-read in the workers.", "bytes",
        (sel("gpumemd_host_rss_bytes"), INST + " trainer"),
        (f"{sel('gpumemd_workers_pss_bytes')} or {sel('gpumemd_workers_rss_bytes')}", INST + " workers"),
        stack=True), w=12)
    g.add(timeseries(
        "Host available, pinned and mapped files", "The host's available memory, torch's pinned host memory, and "
        "the part of the trainer's RSS mapped from files (a memory-mapped dataset's page cache, which the kernel "
        "takes back when memory runs short: the leak detector leaves it out).", "bytes",
        (sel("gpumemd_host_available_bytes"), INST + " host available"),
        (sel("gpumemd_host_pinned_bytes"), INST + " pinned"),
        (sel("gpumemd_host_file_bytes"), INST + " RSS mapped from files")), w=12)

    g.row("Agent")
    g.add(timeseries(
        "Agent overhead", "Share of wall time the agent took from the training thread (budget 1% by "
        "default), and the census part of it.", "percentunit",
        (sel("gpumemd_agent_overhead_ratio"), INST + " total"),
        (f"rate({sel('gpumemd_agent_census_seconds_total')}[$__rate_interval])", INST + " census")), w=8)
    g.add(timeseries(
        "Step time", "Wall time of the last training step; a jump is often a census, a checkpoint "
        "or an allocator retry. Typical: the median of recent steps, which the stale alert scales with.", "s",
        (sel("gpumemd_step_duration_seconds"), INST),
        (sel("gpumemd_step_typical_duration_seconds"), INST + " typical")), w=8)
    g.add(timeseries(
        "Probe errors and scrape health", "Failed probe reads per second (logged once per kind by the "
        "agent) and whether Prometheus can scrape the target (1 = up).", "short",
        (f"rate({sel('gpumemd_probe_errors_total')}[$__rate_interval])", INST + " {{probe}} errors/s"),
        ('up{job=~"$job", training_job=~"$training_job", instance=~"$instance"}', "{{instance}} up")), w=8)
    g.add(stat(
        "Training step", "Number of the last completed training step.", "none",
        (sel("gpumemd_step"), INST)), w=6, h=4)
    g.add(stat(
        "Since the last step", "Time since a training step last ended (exact to within the agent's sampling "
        "stride, at most 10 steps). It climbs while the training thread is blocked even though the agent "
        "keeps answering (alert GpumemdAgentStale past max(10 min, 20 typical steps), outside phases "
        "labelled with gpumemd.phase).", "s",
        (f"time() - {sel('gpumemd_last_step_timestamp_seconds')}", INST),
        thresholds=[(None, "green"), (300, "orange"), (600, "red")]), w=6, h=4)
    g.add(stat(
        "Census duration", "Wall time of the last tensor census (the agent spaces censuses to stay in "
        "its overhead budget).", "s", (sel("gpumemd_census_duration_seconds"), INST)), w=6, h=4)
    g.add(stat(
        "Censuses taken", "Tensor censuses taken since attach.", "short",
        (sel("gpumemd_censuses_total"), INST)), w=6, h=4)

    return {
        "title": "gpumemd: PyTorch memory",
        "uid": "gpumemd",
        "description": "PyTorch memory per rank from gpumemd: allocator, leaks, fragmentation, census, host, agent.",
        "tags": ["gpumemd", "pytorch", "gpu", "memory"],
        "editable": False,
        "graphTooltip": 1,
        "schemaVersion": 39,
        "version": 1,
        "time": {"from": "now-6h", "to": "now"},
        "refresh": "30s",
        "timezone": "",
        "links": [],
        "annotations": {"list": [BUILTIN_ANNOTATIONS, ALERT_ANNOTATIONS]},
        "templating": {"list": templating()},
        "panels": g.panels,
    }


def query_var(name: str, label: str, query: str) -> dict[str, Any]:
    return {
        "name": name, "label": label, "type": "query", "datasource": DS,
        "query": {"query": query, "refId": f"{name}-var"}, "definition": query,
        "refresh": 2, "multi": True, "includeAll": True, "allValue": ".+", "sort": 1,
        "current": {}, "options": [], "hide": 0, "regex": "",
    }


def templating() -> list[dict[str, Any]]:
    return [
        {"name": "datasource", "label": "Data Source", "type": "datasource", "query": "prometheus",
         "current": {}, "options": [], "hide": 0, "refresh": 1, "regex": ""},
        query_var("job", "job", "label_values(gpumemd_info, job)"),
        # Many jobs share job="gpumemd": the training job is the target label the file_sd writers and the
        # PodMonitor set. "All" is ".*": targets without the label stay in.
        {**query_var("training_job", "training job", 'label_values(gpumemd_info{job=~"$job"}, training_job)'),
         "allValue": ".*"},
        query_var("instance", "instance",
                  'label_values(gpumemd_info{job=~"$job", training_job=~"$training_job"}, instance)'),
        query_var("rank", "rank", 'label_values(gpumemd_info{job=~"$job", training_job=~"$training_job", '
                  'instance=~"$instance"}, rank)'),
        query_var("device", "device", 'label_values(gpumemd_allocator_reserved_bytes{job=~"$job", '
                  'training_job=~"$training_job", instance=~"$instance", rank=~"$rank"}, device)'),
    ]


def render() -> str:
    return json.dumps(build(), indent=2) + "\n"


if __name__ == "__main__":
    OUT.write_text(render())
    sys.stdout.write(f"wrote {OUT}\n")
