"""Breakdown, fragmentation verdict and suggestions from hand-written records (pure analysis)."""

from __future__ import annotations

from oom_snapshot_data import NEW_MESSAGE, make_snapshot

from gpumemd.analysis.breakdown import cpu_breakdown, cuda_breakdown
from gpumemd.analysis.oom_message import parse_oom_message
from gpumemd.analysis.snapshot_summary import summarize_snapshot
from gpumemd.analysis.suggestions import suggest
from gpumemd.records.census import Census, CensusGroup, GroupKey
from gpumemd.records.device import CPU, Device
from gpumemd.records.findings import Culprit, Finding
from gpumemd.records.oom import ObserverCall
from gpumemd.records.samples import AllocatorSample, HostSample

CUDA0 = Device.cuda(0)

MiB, GiB = 2**20, 2**30


def _census(device: str = "cuda:0", **by_category: int) -> Census:
    groups = tuple(
        CensusGroup(GroupKey(Device.parse(device), "float32", (n,), category, None), count=1, nbytes=n)
        for category, n in by_category.items() if category != "graph_bytes"
    )
    if "graph_bytes" in by_category:
        groups += (CensusGroup(GroupKey(Device.parse(device), "float32", (), "graph", "loss"), 1, 4,
                               graph_bytes=by_category["graph_bytes"]),)
    return Census(step=9, taken_at=0.0, duration_s=0.01, groups=groups)


def test_observer_third_argument_is_the_total_not_allocated() -> None:
    snap = summarize_snapshot(make_snapshot())[CUDA0]
    call = ObserverCall(device=CUDA0, requested_bytes=8 * MiB, total_or_cap_bytes=40 * MiB,
                        device_free_bytes=3 * MiB, wall_time=0.0)
    b = cuda_breakdown(device=CUDA0, observer=call, snapshot=snap, census=_census(parameter=6 * MiB))
    assert b.total_bytes == 40 * MiB  # the cap/total, while only ~14 MiB is allocated
    assert b.allocated_bytes == 14 * MiB + 512
    assert b.get("parameters") == 6 * MiB
    assert b.get("invisible") == 8 * MiB + 512  # allocated minus what the census saw
    assert b.get("reserved_unallocated") == 8 * MiB - 512
    assert b.get("non_pytorch") == 40 * MiB - 22 * MiB - 3 * MiB
    assert b.get("free") == 3 * MiB


def test_fragmentation_verdict_when_free_memory_is_in_pieces() -> None:
    snap = summarize_snapshot(make_snapshot())[CUDA0]  # 6 MiB+ cached free, largest block 4 MiB, 3 MiB on device
    call = ObserverCall(CUDA0, 8 * MiB, 40 * MiB, 3 * MiB, 0.0)
    b = cuda_breakdown(device=CUDA0, observer=call, snapshot=snap)
    assert b.verdict == "fragmentation"
    assert b.largest_free_block_bytes == 4 * MiB and "pieces" in b.verdict_why
    kinds = [s.kind for s in suggest(b)]
    assert "expandable_segments" in kinds
    assert "expandable_segments" not in [s.kind for s in suggest(b, expandable_segments=True)]


def test_verdict_from_the_message_alone() -> None:
    # 8 MiB failed while 2.12 GiB sat reserved-but-unallocated: PyTorch's own hint, fragmentation.
    b = cuda_breakdown(device=CUDA0, message=parse_oom_message(NEW_MESSAGE))
    assert b.verdict == "fragmentation"
    assert b.total_bytes == round(79.10 * GiB) and b.requested_bytes == 8 * MiB
    assert b.largest_free_block_bytes is None and "unknown" in b.verdict_why
    tight = parse_oom_message(NEW_MESSAGE.replace("2.12 GiB is reserved", "2.00 MiB is reserved"))
    assert cuda_breakdown(device=CUDA0, message=tight).verdict == "capacity"


def test_request_larger_than_the_device_is_a_size_bug_first() -> None:
    b = cuda_breakdown(device=CUDA0, observer=ObserverCall(CUDA0, 100 * GiB, 80 * GiB, 1 * GiB, 0.0),
                       allocator=AllocatorSample(device=CUDA0, allocated_bytes=GiB, reserved_bytes=2 * GiB))
    assert b.verdict == "request_exceeds_device"
    assert suggest(b)[0].kind == "check_request_size"


def test_activations_dominating_suggest_checkpointing_and_micro_batch() -> None:
    b = cuda_breakdown(device=CUDA0, observer=ObserverCall(CUDA0, GiB, 16 * GiB, 0, 0.0),
                       allocator=AllocatorSample(device=CUDA0, allocated_bytes=15 * GiB, reserved_bytes=15 * GiB),
                       census=_census(parameter=2 * GiB, gradient=2 * GiB, optimizer_state=GiB))
    assert b.verdict == "capacity"
    assert b.activations_bytes == 10 * GiB
    by_kind = {s.kind: s for s in suggest(b)}
    assert by_kind["activation_checkpointing"].saving_bytes == int(10 * GiB * 0.6)
    assert by_kind["smaller_micro_batch"].saving_bytes == 5 * GiB
    assert by_kind["zero_grad_set_to_none"].saving_bytes == 2 * GiB
    assert "bf16_optimizer_state" not in by_kind  # 1 GiB of 15 is not dominant
    savings = [s.saving_bytes for s in suggest(b)]
    assert savings == sorted(savings, reverse=True)


def test_optimizer_state_dominating_suggests_bf16_and_8bit() -> None:
    b = cuda_breakdown(device=CUDA0, observer=ObserverCall(CUDA0, GiB, 16 * GiB, 0, 0.0),
                       allocator=AllocatorSample(device=CUDA0, allocated_bytes=12 * GiB, reserved_bytes=12 * GiB),
                       census=_census(parameter=4 * GiB, optimizer_state=8 * GiB))
    by_kind = {s.kind: s for s in suggest(b)}
    assert by_kind["bf16_optimizer_state"].saving_bytes == 4 * GiB
    assert by_kind["8bit_optimizer"].saving_bytes == 6 * GiB
    assert "activation_checkpointing" not in by_kind


def test_confirmed_leak_and_eval_phase() -> None:
    leak = Finding(kind="graph_leak", series="allocated_bytes{device=0}", state="confirmed",
                   slope_bytes_per_step=MiB, slope_low=0.9 * MiB, slope_high=1.1 * MiB, onset_step=50,
                   growth_bytes=300 * MiB, steps_to_oom=10.0, first_step=120, updated_step=350,
                   summary="allocated grows 1 MiB/step.", device=CUDA0,
                   culprits=(Culprit("float32[] with grad_fn", 300, 300 * MiB, holder="train.losses (list)"),))
    b = cuda_breakdown(device=CUDA0, observer=ObserverCall(CUDA0, GiB, 16 * GiB, 0, 0.0),
                       allocator=AllocatorSample(device=CUDA0, allocated_bytes=4 * GiB, reserved_bytes=4 * GiB),
                       census=_census(parameter=2 * GiB, graph_bytes=2 * GiB))
    by_kind = {s.kind: s for s in suggest(b, findings=[leak], phase="eval")}
    assert by_kind["fix_leak"].saving_bytes == 300 * MiB
    assert "train.losses (list)" in by_kind["fix_leak"].why
    assert by_kind["no_grad_eval"].saving_bytes == 2 * GiB + 4  # the graphs and the 0-d loss itself
    assert "detach_kept_tensors" not in by_kind  # the leak finding already says it


def test_cpu_breakdown_against_host_memory() -> None:
    host = HostSample(rss_bytes=3 * GiB, available_bytes=10 * GiB, total_bytes=16 * GiB)
    census = _census("cpu", parameter=GiB, other=512 * MiB)
    from gpumemd.records.oom import OomMessage

    b = cpu_breakdown(message=OomMessage(kind="cpu", format="cpu", requested_bytes=2**60), host=host, census=census)
    assert b.device == CPU and b.total_bytes == 16 * GiB
    assert b.get("parameters") == GiB and b.get("process_other") == 3 * GiB - GiB - 512 * MiB
    assert b.get("non_pytorch") == 3 * GiB and b.get("free") == 10 * GiB
    assert b.verdict == "request_exceeds_device"
    small = cpu_breakdown(message=OomMessage(kind="cpu", format="cpu", requested_bytes=12 * GiB), host=host)
    assert small.verdict == "capacity"


def test_negligible_savings_are_not_advice_and_a_size_bug_stands_alone() -> None:
    tiny = cuda_breakdown(device=CUDA0, observer=ObserverCall(CUDA0, GiB, 16 * GiB, 0, 0.0),
                          allocator=AllocatorSample(CUDA0, allocated_bytes=300 * 1024, reserved_bytes=300 * 1024),
                          census=_census(parameter=100 * 1024, optimizer_state=200 * 1024))
    assert tiny.get("optimizer_state") / tiny.tensor_bytes > 0.5  # dominant, but 100 KiB of 16 GiB
    assert suggest(tiny) == []
    huge = cuda_breakdown(device=CUDA0, observer=ObserverCall(CUDA0, 100 * GiB, 16 * GiB, 0, 0.0),
                          allocator=AllocatorSample(device=CUDA0, allocated_bytes=15 * GiB, reserved_bytes=15 * GiB),
                          census=_census(parameter=GiB))
    assert huge.activations_bytes == 14 * GiB
    assert [s.kind for s in suggest(huge)] == ["check_request_size"]
