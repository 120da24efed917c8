"""Advice for a capacity OOM, from the real H200 first-forward OOM (oom_first_forward_report.md):
``Linear(8192, 65536)`` on a module global ``x`` of 549,718 rows asked for 134.21 GiB with 120.51 GiB
free. Each suggestion is sized on those measurements."""

from __future__ import annotations

from gpumemd.analysis.breakdown import cuda_breakdown
from gpumemd.analysis.oom_message import parse_oom_message
from gpumemd.analysis.suggestions import suggest, why_none
from gpumemd.records.census import Census, CensusGroup, GroupKey, TensorEntry
from gpumemd.records.device import Device
from gpumemd.records.oom import ObserverCall

CUDA0 = Device.cuda(0)
GiB = 2**30
H200_MESSAGE = (
    "CUDA out of memory. Tried to allocate 134.21 GiB. GPU 0 has a total capacity of 139.80 GiB of which 120.51 GiB "
    "is free. Including non-PyTorch memory, this process has 19.29 GiB memory in use. Of the allocated memory 18.78 "
    "GiB is allocated by PyTorch, and 1.31 MiB is reserved by PyTorch but unallocated. If reserved but unallocated "
    "memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See "
    "documentation for Memory Management  (https://docs.pytorch.org/docs/stable/notes/cuda.html#optimizing-memory-"
    "usage-with-pytorch-cuda-alloc-conf)")
ROWS = 549_718
X = TensorEntry(ROWS * 8192 * 4, (ROWS, 8192), "float32", CUDA0, "other", holder="module global `__main__.x`")
WEIGHT = TensorEntry(65536 * 8192 * 4, (65536, 8192), "float32", CUDA0, "parameter", name="weight")
REQUEST = -(-ROWS * 65536 * 4 // 2**21) * 2**21  # the observer's size: the allocator rounds up to 2 MiB


def _breakdown() -> object:
    census = Census(step=0, taken_at=0.0, duration_s=0.1, groups=(
        CensusGroup(GroupKey(CUDA0, "float32", X.shape, "other", None), 1, X.nbytes, holder=X.holder),
        CensusGroup(GroupKey(CUDA0, "float32", WEIGHT.shape, "parameter", "weight"), 1, WEIGHT.nbytes)))
    call = ObserverCall(CUDA0, REQUEST, int(139.80 * GiB), int(120.51 * GiB), 0.0)
    return cuda_breakdown(device=CUDA0, message=parse_oom_message(H200_MESSAGE), observer=call, census=census)


def test_a_capacity_oom_gets_the_batch_that_fits_chunks_and_bf16_each_with_its_saving() -> None:
    b = _breakdown()
    assert b.verdict == "capacity"  # type: ignore[attr-defined]
    by_kind = {s.kind: s for s in suggest(b, largest=[X, WEIGHT])}  # type: ignore[arg-type]
    batch = by_kind["smaller_batch"]
    room = b.get("free") + b.get("reserved_unallocated")  # type: ignore[attr-defined]
    fits = int(ROWS * (room + X.nbytes) / (REQUEST + X.nbytes))
    assert f"at most {fits:,} (now {ROWS:,})" in batch.title and "`__main__.x`" in batch.why
    assert batch.saving_bytes == REQUEST - fits * 65536 * 4  # the request at the batch that fits
    # at that batch the request and x fit in what was left
    assert fits * 65536 * 4 + fits * 8192 * 4 <= room + X.nbytes
    chunks = by_kind["chunk_operation"]
    assert chunks.title == "Run the failing operation in 2 chunks" and chunks.saving_bytes == REQUEST // 2
    assert by_kind["autocast_bf16"].saving_bytes == (REQUEST + X.nbytes) // 2
    assert "expandable_segments" not in by_kind  # 1.31 MiB cached is nothing to defragment
    assert all(s.saving_bytes > 0 for s in by_kind.values())


def test_no_batch_is_named_when_no_census_tensor_scales_with_the_request() -> None:
    b = _breakdown()
    odd = TensorEntry(1000 * 7 * 4, (1000, 7), "float32", CUDA0, "other")  # 134 GiB is no whole number of rows
    (batch,) = [s for s in suggest(b, largest=[odd]) if s.kind == "smaller_batch"]  # type: ignore[arg-type]
    assert batch.title.startswith("Shrink the batch below") and "no census tensor's rows matched" in batch.why


def test_why_none_says_what_was_measured() -> None:
    text = why_none(_breakdown())  # type: ignore[arg-type]
    assert text.startswith("No suggestion: no rule applies. The verdict is capacity")
    assert "None" not in text and "activations" in text
