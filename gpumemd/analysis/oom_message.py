"""Recognise out-of-memory exceptions and read the numbers in their messages (pure; no torch).

Formats (TORCH_MEMORY_API.md §4.3, §4.4):
- CUDA, torch >= 2.1: ``CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of
  79.10 GiB of which 1.05 GiB is free. ... Of the allocated memory 75.20 GiB is allocated by PyTorch,
  and 1.30 GiB is reserved by PyTorch but unallocated. ...`` (2.1 itself spelled "capacty");
- CUDA, before 2.1: ``CUDA out of memory. Tried to allocate 152.00 MiB (GPU 0; 31.72 GiB total
  capacity; 24.89 GiB already allocated; 6.12 MiB free; 30.70 GiB reserved in total by PyTorch)``;
- CPU: a plain ``RuntimeError`` ``... DefaultCPUAllocator: can't allocate memory: you tried to allocate
  1152921504606846976 bytes. Error code 12 (Cannot allocate memory)``.
``Storage size calculation overflowed`` is a shape error, not an allocation failure: not an OOM here.
"""

from __future__ import annotations

import re

from gpumemd.records.oom import OomMessage

# Bounded digit runs, never preceded by another digit: a message is outside input (a user's exception
# can say anything), and ``\d+`` without a literal prefix makes ``search`` quadratic on a long digit
# run (issue 15: 7.6 s for 20k digits inside an excepthook). Real sizes have at most ~20 digits.
_SIZE = r"(?<![\d.])(\d{1,20}(?:\.\d{1,6})?) (bytes|KiB|MiB|GiB|TiB)"
_NEW = re.compile(
    r"CUDA out of memory\. Tried to allocate " + _SIZE + r"\. GPU (\d+) has a total capac(?:i)?ty of "
    + _SIZE + r" of which " + _SIZE + r" is free\."
)
_OLD = re.compile(
    r"CUDA out of memory\. Tried to allocate " + _SIZE + r" \(GPU (\d+); " + _SIZE + r" total capacity; "
    + _SIZE + r" already allocated; " + _SIZE + r" free; " + _SIZE + r" reserved in total by PyTorch\)"
)
_PT = re.compile(
    r"Of the allocated memory " + _SIZE + r" is allocated by PyTorch, (?:with " + _SIZE
    + r" allocated in private pools \(e\.g\., CUDA Graphs\), )?and " + _SIZE
    + r" is reserved by PyTorch but unallocated"
)
_PROCESS = re.compile(r"this process has " + _SIZE + r" memory in use")
_ALLOWED = re.compile(_SIZE + r" allowed; ")
_CPU = re.compile(r"DefaultCPUAllocator: can't allocate memory: you tried to allocate (\d{1,25}) bytes")
_MPS = re.compile(r"MPS backend out of memory")
_MPS_SIZE = re.compile(r"Tried to allocate " + _SIZE)
_UNITS = {"bytes": 1, "KiB": 1024, "MiB": 1024**2, "GiB": 1024**3, "TiB": 1024**4}


def parse_size(number: str, unit: str) -> int:
    """``("152.00", "MiB")`` -> bytes. The message rounds to 2 decimals, so this is approximate."""
    return round(float(number) * _UNITS[unit])


def parse_oom_message(text: str) -> OomMessage | None:
    """The numbers in an OOM message, or None when ``text`` is not an out-of-memory message."""
    if m := _NEW.search(text):
        pt = _PT.search(text)
        process = _PROCESS.search(text)
        allowed = _ALLOWED.search(text)
        return OomMessage(
            kind="cuda",
            format="cuda-2.1+",
            requested_bytes=parse_size(m[1], m[2]),
            device=int(m[3]),
            total_bytes=parse_size(m[4], m[5]),
            free_bytes=parse_size(m[6], m[7]),
            allowed_bytes=parse_size(allowed[1], allowed[2]) if allowed else None,
            process_bytes=parse_size(process[1], process[2]) if process else None,
            allocated_bytes=parse_size(pt[1], pt[2]) if pt else None,
            private_pool_bytes=parse_size(pt[3], pt[4]) if pt and pt[3] else (0 if pt else None),
            reserved_unallocated_bytes=parse_size(pt[5], pt[6]) if pt else None,
            reserved_bytes=(parse_size(pt[1], pt[2]) + parse_size(pt[5], pt[6])) if pt else None,
        )
    if m := _OLD.search(text):
        allocated = parse_size(m[6], m[7])
        reserved = parse_size(m[10], m[11])
        return OomMessage(
            kind="cuda",
            format="cuda-legacy",
            requested_bytes=parse_size(m[1], m[2]),
            device=int(m[3]),
            total_bytes=parse_size(m[4], m[5]),
            free_bytes=parse_size(m[8], m[9]),
            allocated_bytes=allocated,
            reserved_bytes=reserved,
            reserved_unallocated_bytes=max(0, reserved - allocated),
        )
    if m := _CPU.search(text):
        return OomMessage(kind="cpu", format="cpu", requested_bytes=int(m[1]))
    if _MPS.search(text):
        size = _MPS_SIZE.search(text)
        return OomMessage(kind="mps", format="mps", requested_bytes=parse_size(size[1], size[2]) if size else None)
    if "CUDA out of memory" in text:  # a future wording: still an OOM, numbers unknown
        return OomMessage(kind="cuda", format="unparsed")
    return None


def _is_torch_oom_class(exc: BaseException) -> bool:
    # torch.OutOfMemoryError is torch._C.OutOfMemoryError (== torch.cuda.OutOfMemoryError); matching
    # the MRO by name keeps this module free of torch and also accepts user subclasses.
    return any(
        cls.__name__ == "OutOfMemoryError" and (cls.__module__ or "").split(".")[0] == "torch"
        for cls in type(exc).__mro__
    )


def classify_exception(exc: BaseException) -> OomMessage | None:
    """``_classify`` that never raises: an exception whose ``__str__`` raises, or any other surprise,
    is "not recognised" (or an unparsed OOM when its class says OOM), so that code which classifies
    inside an ``except`` or an excepthook never replaces the job's own exception."""
    try:
        return _classify(exc)
    except Exception:  # noqa: BLE001 - outside input: a broken __str__, a pathological message
        try:
            return OomMessage(kind="device", format="unparsed") if _is_torch_oom_class(exc) else None
        except Exception:  # noqa: BLE001
            return None


def _classify(exc: BaseException) -> OomMessage | None:
    """An ``OomMessage`` when ``exc`` is an out-of-memory error, else None.

    OOMs are ``torch.OutOfMemoryError`` (any device), a plain ``RuntimeError`` carrying a CUDA OOM
    message (torch < 1.13, TorchScript), a CPU allocation failure or an MPS OOM. Shape overflows
    (``Storage size calculation overflowed``) and ``torch.AcceleratorError`` are not.
    """
    text = str(exc)
    if _is_torch_oom_class(exc):
        parsed = parse_oom_message(text)
        if parsed is not None:
            return parsed
        return OomMessage(kind="device", format="unparsed")
    if not isinstance(exc, RuntimeError) or "Storage size calculation overflowed" in text:
        return None
    if type(exc).__name__ == "AcceleratorError":  # CUDA runtime errors (cuBLAS, NCCL): not the allocator
        return None
    return parse_oom_message(text)
