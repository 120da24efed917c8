"""The suggestions of a capacity OOM, where the request did not fit in what was left (pure).

Sized on the request and the room left (free memory, the cache, what the cap allows): the batch at
which the request, and the census tensor whose rows it scales with, fit; the fewest chunks of the
operation that each fit; bf16 autocast when that tensor is fp32. ``analysis.suggestions`` runs them
with the other rules (``CAPACITY_RULES``).
"""

from __future__ import annotations

from dataclasses import dataclass

from gpumemd.analysis.breakdown import fmt
from gpumemd.analysis.leak_headline import short_path
from gpumemd.analysis.suggestion_facts import Facts, Rule
from gpumemd.records.census import TensorEntry
from gpumemd.records.oom import Suggestion

_ROUNDING = {True: 2 * 2**20, False: 0}  # the CUDA allocator rounds a large request up to 2 MiB; malloc does not
_ITEMSIZE = {"float64": 8, "int64": 8, "complex64": 8, "float32": 4, "int32": 4, "float16": 2, "bfloat16": 2,
             "int16": 2, "uint8": 1, "int8": 1, "bool": 1}
_BATCH_CATEGORIES = frozenset({"other", "graph"})  # not parameters, gradients, optimizer state or buffers


@dataclass(frozen=True)
class Capacity:
    """What a capacity OOM's advice is sized on: the request, the room left (free, the cache, what the
    cap allows), and the census tensor whose leading dimension the request scales with, if one does."""

    request: int
    room: int
    batch: TensorEntry | None
    row_bytes: int  # of the request, per row of ``batch``


def capacity(facts: Facts) -> Capacity | None:
    """The figures, when the verdict is capacity and the request exceeded the room left."""
    b = facts.breakdown
    request = b.requested_bytes
    if b.verdict != "capacity" or not request:
        return None
    room = (b.get("headroom") or b.get("free")) + b.get("reserved_unallocated")
    if room >= request or room * 100 < request:
        return None  # it fitted; or nearly nothing was left: no batch or chunk of it fits either
    rounding = _ROUNDING[b.device.cuda_index is not None]
    for entry in sorted(facts.largest, key=lambda e: e.nbytes, reverse=True):
        if entry.category not in _BATCH_CATEGORIES or not entry.shape or entry.shape[0] < 2:
            continue
        rows = entry.shape[0]
        size = _ITEMSIZE.get(entry.dtype.removeprefix("torch."), 1)
        row_bytes = request // rows // size * size
        # within the rounding, and rows far enough apart that a match is no chance (any leading
        # dimension under 2 MiB / itemsize would divide a CUDA request within its rounding)
        if row_bytes > 0 and request - rows * row_bytes <= rounding < rows * size:
            return Capacity(request, room, entry, row_bytes)
    return Capacity(request, room, None, 0)


def _tensor_words(entry: TensorEntry) -> str:
    shape = ", ".join(str(d) for d in entry.shape)
    who = short_path(entry.holder) if entry.holder else entry.name  # the report's table has the whole path
    return f"{who or 'the tensor'} ({entry.dtype.removeprefix('torch.')}[{shape}])"


def smaller_batch(facts: Facts) -> list[Suggestion]:
    """The batch that fits: the request and the batch tensor shrink with it, the rest stays."""
    cap = capacity(facts)
    if cap is None:
        return []
    if cap.batch is None:
        share = cap.room / cap.request
        return [Suggestion(
            kind="smaller_batch", title=f"Shrink the batch below {share:.0%} of its size",
            saving_bytes=cap.request - cap.room,
            why=f"The request of {fmt(cap.request)} did not fit in the {fmt(cap.room)} left; if it scales with "
                "the batch, a batch below that share fits (no census tensor's rows matched the request).",
            how="gpumemd.find_batch_size(step_fn) measures the largest batch that fits")]
    rows, held = cap.batch.shape[0], cap.batch.nbytes
    fits = max(1, int(rows * (cap.room + held) / (cap.request + held)))  # the request and the batch shrink
    return [Suggestion(
        kind="smaller_batch", title=f"Use a batch of at most {fits:,} (now {rows:,})",
        saving_bytes=cap.request - fits * cap.row_bytes,
        why=f"The request of {fmt(cap.request)} is {fmt(cap.row_bytes)} for each of the {rows:,} rows of "
            f"{_tensor_words(cap.batch)}, and {fmt(cap.room)} was left: at {fits:,} rows the request and that "
            "tensor fit, with no margin.",
        how=f"batch_size = {fits:,} or less (gpumemd.find_batch_size(step_fn) measures it with a margin)")]


def chunk_operation(facts: Facts) -> list[Suggestion]:
    """The failing operation in the fewest pieces that each fit what was left."""
    cap = capacity(facts)
    if cap is None or cap.room <= 0:
        return []
    pieces = -(-cap.request // cap.room)
    pieces += 1 if -(-cap.request // pieces) > cap.room * 0.9 else 0  # keep a tenth free: fragments
    return [Suggestion(
        kind="chunk_operation", title=f"Run the failing operation in {pieces} chunks",
        saving_bytes=cap.request - -(-cap.request // pieces),
        why=f"Its one request of {fmt(cap.request)} did not fit in the {fmt(cap.room)} left; in {pieces} chunks "
            f"each needs about {fmt(-(-cap.request // pieces))}.",
        how=f"torch.cat([f(part) for part in x.chunk({pieces})])  # or a loop that writes each result out")]


def autocast_bf16(facts: Facts) -> list[Suggestion]:
    """fp32 activations at a capacity OOM: under bf16 autocast the request and they take half."""
    cap = capacity(facts)
    if cap is None:
        return []
    fp32 = sum(e.nbytes + e.graph_bytes for e in facts.largest
               if e.category in _BATCH_CATEGORIES and e.dtype.removeprefix("torch.") == "float32")
    if (cap.batch is not None and cap.batch.dtype.removeprefix("torch.") != "float32") or not fp32:
        return []
    return [Suggestion(
        kind="autocast_bf16", title="Run the forward in bf16 (torch.autocast)",
        saving_bytes=(cap.request + fp32) // 2,
        why=f"The activations are fp32 ({fmt(fp32)} at the OOM): under bf16 autocast the failing request of "
            f"{fmt(cap.request)} and they take about half.",
        how=f'with torch.autocast(device_type="{facts.breakdown.device.kind}", dtype=torch.bfloat16): '
            "out = model(x)")]


CAPACITY_RULES: tuple[Rule, ...] = (smaller_batch, chunk_operation, autocast_bf16)
