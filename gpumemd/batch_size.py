"""``find_batch_size``: the largest batch size whose training step fits, found in a few tries.

The loop every tutorial writes ("start large, halve on OOM"), done properly:

1. **Free everything between tries**: the frames of a caught out-of-memory exception (their
   locals hold the activations of the failed try), ``gc.collect()``, and on CUDA the allocator
   cache (``torch.cuda.empty_cache()``).
2. **Two probe runs, then extrapolate**: peak memory is close to linear in the batch size
   (fixed model state + per-sample activations), so after ``start`` and ``2·start`` the size whose
   peak reaches ``(1 - margin)·capacity`` is predicted from the line through the two largest
   sizes that ran, and **verified** by running it. A verified size refines the line; a failure
   bounds the search from above and the next guess bisects. A guess is never more than
   ``MAX_GROWTH`` (4) times the largest size that ran. At most ``max_tries`` runs.
3. Return the **largest size that ran** within ``(1 - margin)·capacity``, with its **measured** peak:
   a size that ran at 99% of the capacity does not fit (the margin is what a long run needs for
   fragmentation, longer sequences and the other ranks' buffers).

Under ``torch.distributed`` with more than one rank it refuses: one rank's OOM would leave the
others blocked in the step's collectives. Search in one process and hand the size to every rank.

Capacity and measurement:

- CUDA: the peak is ``torch.cuda.max_memory_reserved`` of the try (peak counters are reset and the
  cache emptied before each try): reserved, not allocated, because the cache's fragmentation is what
  a long run will need as well, so the margin is kept on reserved memory. The capacity is
  ``budget_bytes`` or else ``min(total × per-process fraction, driver free + reserved)``: other
  processes on the GPU and the CUDA context take their share too. ``set_per_process_memory_fraction``
  is the way to test with a cap, and real OOMs (cuBLAS/cuDNN allocation failures included) end tries.
- CPU (or any run with ``budget_bytes``): on CPU the peak is measured from the profiler's
  allocator events (``gpumemd.probes.planning.cpu_peak``): tensor bytes allocated since the search
  started, so the model's parameters created before the call are not counted, while optimizer
  state created lazily by the first try is. A try whose measured peak exceeds ``budget_bytes``
  counts as out of memory, exactly like a real allocation failure, which also counts.

``step_fn`` must leave nothing behind between tries: zero the gradients (``set_to_none=True``)
inside it, or pass ``reset_fn`` (called after every try, failed or not), else one try's gradients
and optimizer state count against the next. Any exception that is not an out-of-memory error
propagates unchanged.
"""

from __future__ import annotations

import gc
import logging
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("gpumemd")

# At most this factor above the largest size that ran, per try. Peak memory is linear in the batch
# size only once activations outgrow the optimizer step's temporaries (below that it is flat), so a
# line through two small sizes can overshoot by orders of magnitude; on CPU, where the budget is
# checked after the try, an unbounded overshoot could exhaust the host's real memory.
MAX_GROWTH = 4


@dataclass(frozen=True, slots=True)
class Try:
    batch_size: int
    ran: bool  # completed without an out-of-memory error
    peak_bytes: int | None  # measured; None when it ran out of memory
    fits: bool  # ran, and the peak is within the budget


def _release(exc: BaseException) -> None:
    """Drop what a caught exception keeps alive: the locals of every frame it unwound through."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if current.__traceback__ is not None:
            traceback.clear_frames(current.__traceback__)
            current.__traceback__ = None
        current = current.__cause__ or current.__context__


class _Runner:
    """Runs one try and measures its peak; frees everything before returning."""

    def __init__(self, step_fn: Callable[[int], Any], device: str, budget: int,
                 reset_fn: Callable[[], Any] | None = None) -> None:
        self.step_fn = step_fn
        self.reset_fn = reset_fn
        self.device = device
        self.budget = budget
        self.cpu_offset = 0  # CPU: bytes earlier tries left allocated (lazy optimizer state)

    def run(self, batch_size: int) -> Try:
        ran, peak = self._run_cuda(batch_size) if self.device.startswith("cuda") else self._run_cpu(batch_size)
        result = Try(batch_size, ran, peak, ran and peak is not None and peak <= self.budget)
        log.debug("gpumemd.find_batch_size: batch %d -> %s", batch_size, result)
        return result

    def _call(self, batch_size: int) -> bool:
        from gpumemd.analysis.oom_message import classify_exception
        from gpumemd.components.oom_capture import probing  # not at import: ``import gpumemd`` stays light

        try:
            with probing():  # a try's OOM is gpumemd's own, not one the job caught: no report
                self.step_fn(batch_size)  # the result is dropped at once
        except Exception as exc:
            if classify_exception(exc) is None:  # the one classifier the OOM reports use
                raise
            _release(exc)
            return False
        finally:
            if self.reset_fn is not None:
                self.reset_fn()
        return True

    def _run_cpu(self, batch_size: int) -> tuple[bool, int | None]:
        from gpumemd.probes.planning.cpu_peak import memory_profile, peak_from_profiler

        with memory_profile() as prof:
            ran = self._call(batch_size)
            gc.collect()  # inside the window, so the frees are recorded too
        measured = peak_from_profiler(prof)
        peak = self.cpu_offset + measured.peak_bytes
        self.cpu_offset += measured.net_bytes
        return ran, peak if ran else None

    def _run_cuda(self, batch_size: int) -> tuple[bool, int | None]:
        import torch

        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        ran = self._call(batch_size)
        if ran:
            torch.cuda.synchronize(self.device)
        peak = int(torch.cuda.max_memory_reserved(self.device))
        gc.collect()
        torch.cuda.empty_cache()
        return ran, peak if ran else None


def _cuda_capacity(device: str) -> int:
    """What this process can fill: its cap (total × fraction), but never more than the driver's free
    memory plus what this process's cache already holds (other processes and the context use the rest)."""
    import torch

    index = torch.device(device).index
    index = torch.cuda.current_device() if index is None else index
    total = int(torch.cuda.get_device_properties(index).total_memory)
    fraction_fn = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    fraction = float(fraction_fn(index)) if fraction_fn is not None else 1.0
    gc.collect()
    torch.cuda.empty_cache()
    free, _total = torch.cuda.mem_get_info(index)
    reachable = int(free) + int(torch.cuda.memory_reserved(index))
    return min(int(total * fraction), reachable)


def _round_down(value: int, multiple: int) -> int:
    return max(multiple, value - value % multiple)


def find_batch_size(
    step_fn: Callable[[int], Any],
    start: int = 8,
    max: int = 4096,
    budget_bytes: int | None = None,
    *,
    margin: float = 0.1,
    device: str | None = None,
    max_tries: int = 12,
    multiple_of: int = 1,
    reset_fn: Callable[[], Any] | None = None,
) -> tuple[int, int]:
    """Largest batch size in ``[1, max]`` whose step ran within the capacity, and its measured peak.

    ``step_fn(batch_size)`` runs one full training step (forward, backward, optimizer step) at that
    batch size, and must zero the gradients itself unless ``reset_fn`` does (it is called after
    every try, e.g. ``lambda: optimizer.zero_grad(set_to_none=True)``). ``margin`` is the fraction
    of the capacity kept free when extrapolating.
    Raises ``RuntimeError`` when not even batch size ``multiple_of`` fits.
    """
    import torch

    if not isinstance(start, int) or start < 1:
        raise ValueError(f"find_batch_size(start={start!r}) is not valid: expected an integer >= 1")
    if not isinstance(max, int) or max < start:
        raise ValueError(f"find_batch_size(max={max!r}) is not valid: expected an integer >= start ({start})")
    if not 0 <= margin < 1:
        raise ValueError(f"find_batch_size(margin={margin!r}) is not valid: expected a fraction in [0, 1)")
    if multiple_of < 1 or max_tries < 2:
        raise ValueError("find_batch_size: multiple_of must be >= 1 and max_tries >= 2")
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if budget_bytes is None:
        if not device.startswith("cuda"):
            raise ValueError(
                f"find_batch_size on {device} needs budget_bytes (there is no device capacity to read); "
                "pass e.g. budget_bytes=2 * 1024**3"
            )
        budget_bytes = _cuda_capacity(device)
    if budget_bytes < 1:
        raise ValueError(f"find_batch_size(budget_bytes={budget_bytes!r}) is not valid: expected bytes >= 1")
    _refuse_under_distributed(torch)
    runner = _Runner(step_fn, device, budget_bytes, reset_fn)
    return search(runner.run, start=start, max_size=max, budget_bytes=budget_bytes, margin=margin,
                  max_tries=max_tries, multiple_of=multiple_of)


def _refuse_under_distributed(torch: Any) -> None:
    dist = getattr(torch, "distributed", None)
    try:
        ranks = int(dist.get_world_size()) if dist is not None and dist.is_available() and dist.is_initialized() else 1
    except Exception:  # noqa: BLE001 - a broken process group is not ours to diagnose here
        ranks = 1
    if ranks > 1:
        raise RuntimeError(
            f"find_batch_size under torch.distributed (world size {ranks}): one rank's out-of-memory would "
            "leave the other ranks blocked in the step's collectives. Run it in a single process (before "
            "init_process_group, or with torchrun --nproc-per-node 1) and pass the size it finds to every rank"
        )


def search(
    run: Callable[[int], Try],
    *,
    start: int,
    max_size: int,
    budget_bytes: int,
    margin: float = 0.1,
    max_tries: int = 12,
    multiple_of: int = 1,
) -> tuple[int, int]:
    """The search itself, over any ``run(batch_size) -> Try`` (pure: tests feed it synthetic peaks)."""
    target = budget_bytes * (1 - margin)
    tries: list[Try] = []

    def attempt(size: int) -> Try:
        result = run(size)
        if result.fits and (result.peak_bytes is None or result.peak_bytes > target):
            result = Try(result.batch_size, result.ran, result.peak_bytes, False)  # ran, but inside the margin
        tries.append(result)
        return result

    start = _round_down(start, multiple_of)
    max_size = _round_down(max_size, multiple_of)
    good: dict[int, int] = {}  # batch size -> measured peak, for sizes that fit
    hi: int | None = None  # smallest size known not to fit

    # 1. the first probe; halve until something fits
    size = start
    while True:
        first = attempt(size)
        if first.fits and first.peak_bytes is not None:
            good[size] = first.peak_bytes
            break
        hi = size
        if size <= multiple_of:
            raise RuntimeError(
                f"find_batch_size: batch size {size} does not fit in {int(target)} bytes ({budget_bytes} "
                f"less the margin of {margin:.0%}) "
                f"(tries: {tries}); reduce the model or raise the budget"
            )
        if len(tries) >= max_tries:
            raise RuntimeError(f"find_batch_size: nothing fit in {max_tries} tries: {tries}")
        size = _round_down(size // 2, multiple_of)

    # 2. the second probe, then extrapolate and verify
    while len(tries) < max_tries:
        lo = max(good)
        if lo >= max_size or (hi is not None and hi - lo <= multiple_of):
            break
        guess = _next_guess(good, hi, target, max_size, multiple_of)
        if guess is None or guess <= lo:
            break
        verified = attempt(guess)
        if verified.fits and verified.peak_bytes is not None:
            good[guess] = verified.peak_bytes
        else:
            hi = guess if hi is None else min(hi, guess)
    best = max(good)
    return best, good[best]


def _next_guess(good: dict[int, int], hi: int | None, target: float, cap: int, multiple_of: int) -> int | None:
    lo = max(good)
    upper = cap if hi is None else hi - multiple_of
    if len(good) < 2:
        guess = 2 * lo  # the second probe
    else:
        (b1, p1), (b2, p2) = sorted(good.items())[-2:]
        slope = (p2 - p1) / (b2 - b1)
        if slope <= 0:
            guess = upper
        else:
            guess = int((target - (p2 - slope * b2)) // slope)
            if guess <= lo:
                return None  # the line says lo is already the largest within the margin
    if hi is not None and guess >= hi:
        guess = (lo + hi) // 2  # the line overshot a known failure: bisect
    guess = min(guess, upper, MAX_GROWTH * lo)
    guess = guess - guess % multiple_of
    return guess if guess > lo else None
