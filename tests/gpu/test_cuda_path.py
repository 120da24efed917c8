"""What only a real CUDA device can check: the per-process cap at an OOM, the
cudaMallocAsync backend, expandable segments, an allocation history the job switched on itself,
CUDA_VISIBLE_DEVICES by index and by UUID, and a CPU job that must leave CUDA alone.

Each job runs in a fresh interpreter (``run_job``): the allocator backend and its settings are fixed
when CUDA initialises, a cap or a full device must not outlive the test, and a CUDA hang ends at the
timeout instead of hanging the suite. A job prints its facts as one ``RESULT {json}`` line.

torch 2.13 facts these checks rely on (read in the wheel's own sources, C++ from pytorch upstream):
- ``set_per_process_memory_fraction(f)`` caps the native allocator at ``f × total``; the OOM message
  then says "<cap> allowed;" and the OOM observer's third argument is the cap, not the total;
- ``backend:cudaMallocAsync`` raises "Allocation on device N would exceed allowed memory. (out of
  memory)" with "Currently allocated / Requested / Device limit / Free (according to CUDA)" lines,
  and fills only allocated/active/reserved (current, peak) in ``memory_stats``;
- ``torch._C._cuda_isHistoryEnabled()`` reports the recording of the current device's allocator;
- ``str(get_device_properties(i).uuid)`` is the 8-4-4-4-12 hex form without NVML's ``GPU-`` prefix;
- ``torch._C._cuda_getDeviceCount`` (``torch.cuda.is_available()``) poisons fork even when CUDA
  stays uninitialised; ``torch.cuda.device_count()`` asks NVML first and does not.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

import gpumemd

REPO = Path(gpumemd.__file__).resolve().parent.parent
TIMEOUT_S = 300  # a job that takes longer is hung (CUDA init, a driver call): fail, never hang the suite
MiB = 1 << 20
GiB = 1 << 30
SLACK = 64 * MiB  # messages round sizes to 0.01 GiB; small-pool segments; the CUDA context's drift
_ALLOC_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF",
               "PYTORCH_NO_CUDA_MEMORY_CACHING")

PRELUDE = textwrap.dedent('''
    import json, os, sys
    import torch
    import gpumemd
    from gpumemd.records.plain import plain

    OUT = sys.argv[1]
    ARGS = sys.argv[2:]
    HELD = []  # what fill_until_oom keeps: module level, so oom_guard's frame clearing keeps it too


    def emit(**facts):
        print("RESULT " + json.dumps(facts), flush=True)


    def make_job():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.ReLU(),
                                    torch.nn.Linear(1024, 1024)).cuda()
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


    def train(model, opt, steps):
        for _ in range(steps):
            model(torch.randn(64, 1024, device="cuda")).pow(2).mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)


    def fill_until_oom(chunk):
        """Keep chunk-byte tensors until the allocator refuses one, inside gpumemd.oom_guard (which
        writes the report and lets the OOM go on); the OOM's message."""
        limit = 4 * torch.cuda.mem_get_info()[1] // chunk + 8
        try:
            with gpumemd.oom_guard():
                for _ in range(limit):
                    HELD.append(torch.empty(chunk, dtype=torch.uint8, device="cuda"))
        except torch.OutOfMemoryError as exc:
            return str(exc)
        raise AssertionError(f"no OOM after {limit} allocations of {chunk} bytes")


    def only_report(agent):
        reports = agent.reports()
        assert len(reports) == 1, reports
        return reports[0]

''')


def run_job(tmp_path: Path, name: str, body: str, *, env: dict[str, str] | None = None,
            args: Sequence[str] = ()) -> dict[str, Any]:
    """Run ``body`` (after ``PRELUDE``) in a fresh interpreter; its ``RESULT`` facts."""
    where = tmp_path / name
    where.mkdir()
    script = where / "job.py"
    script.write_text(PRELUDE + textwrap.dedent(body))
    child_env = {k: v for k, v in os.environ.items() if not k.startswith("GPUMEMD_") and k not in _ALLOC_VARS}
    child_env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    child_env.update(env or {})
    proc = subprocess.run([sys.executable, str(script), str(where / "gpumemd-out"), *args], capture_output=True,
                          text=True, env=child_env, timeout=TIMEOUT_S, check=False)
    assert proc.returncode == 0, f"job {name} exited {proc.returncode}:\n{proc.stdout[-2000:]}\n{proc.stderr[-6000:]}"
    results = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert results, f"job {name} printed no RESULT line:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    facts: dict[str, Any] = json.loads(results[-1].removeprefix("RESULT "))
    return facts


def load_report(path: str) -> dict[str, Any]:
    with open(os.path.join(path, "report.json"), encoding="utf-8") as f:
        report: dict[str, Any] = json.load(f)
    return report


# --- 1. the per-process cap ------------------------------------------------------------------------

CAP_JOB = """
    torch.cuda.set_per_process_memory_fraction(0.25)
    model, opt = make_job()
    agent = gpumemd.attach(model=model, optimizer=opt, output_dir=OUT)
    train(model, opt, 3)
    message = fill_until_oom(64 << 20)
    free, total = torch.cuda.mem_get_info()
    emit(report=only_report(agent), message=message, total=total, device_free=free,
         fraction=torch.cuda.get_per_process_memory_fraction())
    gpumemd.detach()
"""

# Breakdown items that stand for memory the job could still have had. Today there is "free"; a separate
# headroom item may come; whichever the breakdown has must respect the cap.
FREE_KEYS = frozenset({"free", "headroom"})


def test_under_a_per_process_cap_the_oom_breakdown_is_bounded_by_the_cap(tmp_path: Path) -> None:
    facts = run_job(tmp_path, "cap", CAP_JOB)
    report = load_report(facts["report"])
    cap = 0.25 * facts["total"]
    assert facts["fraction"] == 0.25
    assert "allowed;" in facts["message"], facts["message"]  # the allocator's own words for a cap
    # The cap as torch states it: the observer's third argument and the message's "X allowed;".
    assert report["observer"] is not None and report["observer"]["total_or_cap_bytes"] == pytest.approx(cap, rel=0.01)
    assert report["oom"]["allowed_bytes"] == pytest.approx(cap, rel=0.01)
    breakdown = report["breakdown"]
    assert breakdown["device"] == "cuda:0"
    assert breakdown["total_bytes"] == pytest.approx(cap, rel=0.01)
    reserved = breakdown["reserved_bytes"]
    assert reserved is not None and 0 < reserved <= cap + SLACK
    headroom = max(0.0, cap - reserved)
    device_free = report["observer"]["device_free_bytes"]
    if device_free <= headroom + GiB:
        pytest.skip(f"the device itself was nearly full ({device_free} bytes free): the cap and the device "
                    "cannot be told apart here")

    # Headroom is min(device_free, cap - reserved), never the device-wide free memory
    # (tens of GiB here, while the cap left less than one 64 MiB chunk). The breakdown in
    # gpumemd/analysis/breakdown.py has no cap-aware field yet: its "free" item is the device's free
    # memory, so these assertions fail until that change lands. They hold whatever the field is called.
    items = {item["key"]: item["nbytes"] for item in breakdown["items"]}
    shown = FREE_KEYS & items.keys()
    assert shown, f"the breakdown shows no free memory at all: {sorted(items)}"
    for key in sorted(shown):
        assert items[key] <= headroom + SLACK, (
            f"breakdown item {key!r} shows {items[key]} bytes available, but the cap of {cap:.0f} bytes "
            f"with {reserved} reserved left only {headroom:.0f}")
    if breakdown.get("headroom_bytes") is not None:  # a field of its own, should the fix add one
        assert breakdown["headroom_bytes"] <= headroom + SLACK
    # The items partition what the job could use (the cap): device-wide free memory on top of the cap
    # would make them add up to far more.
    assert sum(items.values()) <= breakdown["total_bytes"] + SLACK, items
    assert breakdown["verdict"] in ("capacity", "fragmentation"), breakdown["verdict_why"]


# --- 2. backend:cudaMallocAsync ----------------------------------------------------------------------

ASYNC_JOB = """
    model, opt = make_job()
    backend = torch.cuda.memory.get_allocator_backend()
    agent = gpumemd.attach(model=model, optimizer=opt, output_dir=OUT)
    train(model, opt, 5)
    message = fill_until_oom(1 << 30)
    agent.tick()  # a fresh allocator sample, after the OOM
    emit(backend=backend, message=message, report=only_report(agent), total=torch.cuda.mem_get_info()[1],
         samples=[plain(s) for s in agent.state().allocator])
    gpumemd.detach()
"""

# Stats cudaMallocAsync does not maintain (torch.cuda.memory_stats: "always reported as zero").
ASYNC_ABSENT = ("inactive_split_bytes", "requested_bytes", "num_alloc_retries", "num_ooms", "num_oom_rejections",
                "num_device_alloc", "num_device_free", "segment_count")


def test_cuda_malloc_async_oom_is_parsed_and_unmaintained_stats_are_absent(tmp_path: Path) -> None:
    facts = run_job(tmp_path, "async", ASYNC_JOB, env={"PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync"})
    assert facts["backend"] == "cudaMallocAsync"
    assert "would exceed allowed memory" in facts["message"], facts["message"]
    report = load_report(facts["report"])
    oom = report["oom"]
    assert oom["format"] == "cuda-async", oom
    assert oom["device"] == 0  # the device is the message's, never a default
    assert oom["requested_bytes"] == pytest.approx(GiB, rel=0.01)
    assert oom["total_bytes"] == pytest.approx(facts["total"], rel=0.01)  # "Device limit"
    assert oom["allowed_bytes"] is None  # no memory fraction set: the "PyTorch limit" line is no cap
    assert report["breakdown"]["device"] == "cuda:0"
    assert report["breakdown"]["requested_bytes"] == pytest.approx(GiB, rel=0.01)

    samples = {s["device"]: s for s in facts["samples"]}
    assert set(samples) == {0}, facts["samples"]
    sample = samples[0]
    assert sample["allocated_bytes"] and sample["reserved_bytes"]  # what the backend does maintain
    for field in ASYNC_ABSENT:
        assert sample[field] is None, f"{field} is {sample[field]!r} under cudaMallocAsync (torch reports 0)"


# --- 3. expandable_segments:True ---------------------------------------------------------------------

EXPANDABLE_JOB = """
    model, opt = make_job()
    agent = gpumemd.attach(model=model, optimizer=opt, output_dir=OUT)
    train(model, opt, 5)
    expandable = sum(1 for s in torch.cuda.memory._snapshot()["segments"] if s.get("is_expandable"))
    # the agent's own allocator reading after those steps: inactive_split is not maintained there
    split = [a.inactive_split_bytes for a in agent.state().allocator]
    fill_until_oom(256 << 20)
    emit(expandable=expandable, report=only_report(agent), total=torch.cuda.mem_get_info()[1], split=split)
    gpumemd.detach()
"""


def test_expandable_segments_oom_report(tmp_path: Path) -> None:
    facts = run_job(tmp_path, "expandable", EXPANDABLE_JOB, env={"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"})
    if facts["expandable"] == 0:
        pytest.skip("expandable segments are not supported here (torch fell back to cudaMalloc segments)")
    report = load_report(facts["report"])
    assert report["snapshot"]["source"] == "oom_observer"
    devices = {d["device"]: d for d in report["snapshot"]["devices"]}
    assert devices[0]["expandable_segments"] >= 1  # the report read the real snapshot format
    breakdown = report["breakdown"]
    assert breakdown["device"] == "cuda:0"
    assert breakdown["requested_bytes"]  # the observer's rounded size (the mapping it failed to make)
    allocated, reserved = breakdown["allocated_bytes"], breakdown["reserved_bytes"]
    assert allocated is not None and reserved is not None
    assert 0 < allocated <= reserved <= breakdown["total_bytes"] + SLACK
    assert breakdown["verdict"] not in ("request_exceeds_device", "unknown"), breakdown["verdict_why"]
    # It is on already: the report must not tell the job to switch it on.
    assert "expandable_segments" not in {s["kind"] for s in report["suggestions"]}
    # Fragmentation: torch leaves inactive_split at 0 under expandable segments whatever the pieces
    # (pytorch/pytorch#159564); gpumemd reads it as absent, never as "no fragmentation".
    assert facts["split"] and all(v is None for v in facts["split"]), facts["split"]
    # the verdict then rests on the snapshot's largest free block, not on that zero
    assert breakdown["largest_free_block_bytes"] is not None


# --- 4. a history the job switched on itself -----------------------------------------------------------

JOB_ENTRIES = 2000

HISTORY_JOB = f"""
    JOB_ENTRIES = {JOB_ENTRIES}
    settings = json.loads(ARGS[0])
    model, opt = make_job()  # CUDA is up: the allocator the recording configures exists
    torch.cuda.memory._record_memory_history(enabled="all", context="alloc", stacks="python",
                                             max_entries=JOB_ENTRIES)
    enabled_by_job = torch._C._cuda_isHistoryEnabled()
    agent = gpumemd.attach(model=model, optimizer=opt, output_dir=OUT, **settings)
    train(model, opt, 5)
    total = torch.cuda.get_device_properties(0).total_memory
    try:
        with gpumemd.oom_guard():
            torch.empty(2 * total, dtype=torch.uint8, device="cuda")  # < 1 EiB: the observer fires
    except torch.OutOfMemoryError:
        pass
    report = only_report(agent)
    while_attached = torch._C._cuda_isHistoryEnabled()
    gpumemd.detach()
    after_detach = torch._C._cuda_isHistoryEnabled()
    for _ in range(3 * JOB_ENTRIES):  # alloc + free events: the ring buffer wraps at the job's size
        torch.empty(1024, device="cuda")
    traces = torch.cuda.memory._snapshot()["device_traces"][torch.cuda.current_device()]
    emit(enabled_by_job=enabled_by_job, while_attached=while_attached, after_detach=after_detach,
         trace_entries=len(traces), report=report)
    torch.cuda.memory._record_memory_history(enabled=None)
"""


@pytest.mark.parametrize("settings", [{}, {"record_history": True}], ids=["default", "record_history"])
def test_a_history_the_job_switched_on_is_never_reconfigured_or_switched_off(
        tmp_path: Path, settings: dict[str, Any]) -> None:
    facts = run_job(tmp_path, "history", HISTORY_JOB, args=[json.dumps(settings)])
    assert facts["enabled_by_job"], "the job's own _record_memory_history did not switch recording on"
    assert facts["while_attached"]
    assert facts["after_detach"], "gpumemd switched off the job's allocation history"
    # gpumemd's history_max_entries (100,000) would have replaced the job's 2,000-entry ring buffer.
    assert 0 < facts["trace_entries"] <= JOB_ENTRIES, facts["trace_entries"]
    report = load_report(facts["report"])
    assert report["snapshot"]["source"] == "oom_observer"
    devices = {d["device"]: d for d in report["snapshot"]["devices"]}
    assert devices[0]["trace_entries"] > 0  # the report used the job's recording


# --- 5. CUDA_VISIBLE_DEVICES by index and by UUID ------------------------------------------------------

IDENTITY_JOB = """
    import pynvml
    uuid = "GPU-" + str(torch.cuda.get_device_properties(0).uuid)
    pynvml.nvmlInit()
    nvml_uuids = [pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(i))
                  for i in range(pynvml.nvmlDeviceGetCount())]
    emit(uuid=uuid, nvml_uuids=[u.decode() if isinstance(u, bytes) else u for u in nvml_uuids])
"""

NVML_JOB = """
    import pynvml
    model, opt = make_job()
    agent = gpumemd.attach(model=model, optimizer=opt, output_dir=OUT)
    train(model, opt, 5)
    torch.cuda.synchronize()
    agent.tick()
    samples = [plain(s) for s in agent.state().nvml]
    # NVML's own reading of the GPU this process runs on, found by the UUID CUDA gives it
    uuid = "GPU-" + str(torch.cuda.get_device_properties(0).uuid)
    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByUUID(uuid)
    mem = None
    if hasattr(pynvml, "nvmlMemory_v2"):  # as gpumemd reads it: v2 ("used" without driver-reserved)
        try:
            mem = pynvml.nvmlDeviceGetMemoryInfo(handle, version=pynvml.nvmlMemory_v2)
        except pynvml.NVMLError:
            mem = None
    if mem is None:
        mem = pynvml.nvmlDeviceGetMemoryInfo(handle)
    mine = []
    for call in ("nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetComputeRunningProcesses_v2"):
        try:
            mine = [p.usedGpuMemory for p in getattr(pynvml, call)(handle) if p.pid == os.getpid()]
            break
        except (pynvml.NVMLError, AttributeError):
            continue
    emit(samples=samples, uuid=uuid, device_count=torch.cuda.device_count(), total=int(mem.total),
         used=int(mem.used), free=int(mem.free), mine=[m for m in mine if isinstance(m, int)])
    gpumemd.detach()
"""


@pytest.fixture(scope="module")
def first_gpu(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, int]:
    """The UUID of this environment's CUDA device 0 and its NVML index."""
    pytest.importorskip("pynvml")
    facts = run_job(tmp_path_factory.mktemp("identity"), "identity", IDENTITY_JOB)
    if facts["uuid"] not in facts["nvml_uuids"]:
        pytest.skip(f"CUDA device 0 ({facts['uuid']}) is not a whole GPU NVML lists (a MIG instance?)")
    return facts["uuid"], facts["nvml_uuids"].index(facts["uuid"])


@pytest.mark.parametrize("form", ["index", "uuid"])
def test_cuda_visible_devices_by_index_and_uuid_reads_that_gpu(
        tmp_path: Path, first_gpu: tuple[str, int], form: str) -> None:
    uuid, nvml_index = first_gpu
    if form == "index":
        # PCI bus order is NVML's order, so the index names the same GPU to CUDA and to NVML.
        env = {"CUDA_VISIBLE_DEVICES": str(nvml_index), "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    else:
        env = {"CUDA_VISIBLE_DEVICES": uuid}
    facts = run_job(tmp_path, form, NVML_JOB, env=env)
    assert facts["device_count"] == 1 and facts["uuid"] == uuid
    assert len(facts["samples"]) == 1, facts["samples"]
    (sample,) = facts["samples"]
    assert sample["device"] == 0  # CUDA's ordinal in this process, not NVML's index
    assert sample["total_bytes"] == facts["total"]
    # Read a moment apart in one process that allocates nothing in between: the same GPU's figures.
    assert abs(sample["used_bytes"] - facts["used"]) <= 4 * SLACK, (sample, facts)
    assert abs(sample["free_bytes"] - facts["free"]) <= 4 * SLACK, (sample, facts)
    if facts["mine"]:  # NVML lists this pid (no PID namespace in the way): gpumemd found it too
        assert sample["process_used_bytes"] is not None
        assert abs(sample["process_used_bytes"] - facts["mine"][0]) <= SLACK


# --- 6. a CPU job leaves CUDA alone ------------------------------------------------------------------

CPU_JOB = """
    attach = ARGS[0] == "attach"
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    agent = gpumemd.attach(model=model, optimizer=opt, output_dir=OUT) if attach else None
    for _ in range(50):
        loss = model(torch.randn(16, 32)).pow(2).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    steps = 0
    if agent is not None:
        agent.tick()
        steps = agent.state().steps_total
    while_attached = torch.cuda.is_initialized()
    gpumemd.detach()
    after_detach = torch.cuda.is_initialized()
    # A DataLoader forking now: would its worker find CUDA poisoned (cudaGetDeviceCount in this process)?
    pid = os.fork()
    if pid == 0:
        os._exit(1 if torch.cuda._is_in_bad_fork() else 0)
    _, status = os.waitpid(pid, 0)
    emit(steps=steps, while_attached=while_attached, after_detach=after_detach,
         fork_poisoned=os.waitstatus_to_exitcode(status) == 1)
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_cpu_job_with_gpumemd_attached_leaves_cuda_uninitialised(tmp_path: Path) -> None:
    alone = run_job(tmp_path, "alone", CPU_JOB, args=["alone"])
    assert not alone["while_attached"] and not alone["after_detach"], "the CPU job itself initialised CUDA"
    facts = run_job(tmp_path, "attached", CPU_JOB, args=["attach"])
    assert facts["steps"] == 50
    assert facts["while_attached"] is False
    assert facts["after_detach"] is False
    if not alone["fork_poisoned"]:  # torch itself leaves fork safe here: gpumemd must too
        assert facts["fork_poisoned"] is False, "gpumemd called cudaGetDeviceCount (is_available?) in a CPU job"


# --- 7. an OOM in the first forward, attach() before any CUDA use --------------------------------------

FIRST_FORWARD_JOB = """
    agent = gpumemd.attach(output_dir=OUT, record_history=False)  # as the README says: before .cuda()
    before = torch.cuda.is_initialized()
    queued = [getattr(fn, "__qualname__", "") for fn, _ in torch.cuda._queued_calls]
    model = torch.nn.Linear(1024, 1024).cuda()  # the job's first CUDA use runs torch's lazy-init queue
    total = torch.cuda.get_device_properties(0).total_memory
    try:
        with gpumemd.oom_guard():  # the first forward, no step ended: only the observer can see it
            model(torch.randn(64, 1024, device="cuda")) + torch.empty(2 * total, dtype=torch.uint8, device="cuda")
    except torch.OutOfMemoryError:
        pass
    emit(before=before, queued=queued, report=only_report(agent), total=total,
         steps=agent.state().steps_total, num_ooms=torch.cuda.memory_stats()["num_ooms"])
    gpumemd.detach()
"""


def test_an_oom_in_the_first_forward_is_captured_by_the_observer(tmp_path: Path) -> None:
    facts = run_job(tmp_path, "first_forward", FIRST_FORWARD_JOB)
    assert facts["before"] is False, "attach() initialised CUDA"
    assert any("attach_oom_observer_at_init" in name for name in facts["queued"]), facts["queued"]
    assert facts["steps"] == 0 and facts["num_ooms"] == 1
    report = load_report(facts["report"])
    assert report["snapshot"]["source"] == "oom_observer", report["snapshot"]
    assert report["observer"] is not None and report["observer"]["total_or_cap_bytes"] == facts["total"]
    assert report["observer"]["requested_bytes"] >= 2 * facts["total"]
    devices = {d["device"]: d for d in report["snapshot"]["devices"]}
    assert devices[0]["allocated_bytes"] >= 1024 * 1024 * 4  # the weights, read inside the allocator
