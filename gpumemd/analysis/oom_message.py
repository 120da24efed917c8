"""Recognise out-of-memory exceptions and read the numbers in their messages (pure; no torch).

Formats (TORCH_MEMORY_API.md §4.3, §4.4):
- CUDA, torch >= 2.1: ``CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of
  79.10 GiB of which 1.05 GiB is free. ... Of the allocated memory 75.20 GiB is allocated by PyTorch,
  and 1.30 GiB is reserved by PyTorch but unallocated. ...`` (2.1 itself spelled "capacty");
- CUDA, before 2.1: ``CUDA out of memory. Tried to allocate 152.00 MiB (GPU 0; 31.72 GiB total
  capacity; 24.89 GiB already allocated; 6.12 MiB free; 30.70 GiB reserved in total by PyTorch)``;
  (with ``X allowed;`` before "reserved" when a per-process memory fraction is set);
- CUDA, ``backend:cudaMallocAsync``: ``Allocation on device 0 would exceed allowed memory. (out of
  memory)`` then ``Currently allocated : / Requested : / Device limit : / Free (according to CUDA):``
  lines and the memory-fraction limit (c10/cuda/CUDAMallocAsyncAllocator.cpp);
- CUDA runtime and libraries: ``CUDA error: out of memory`` (``torch.AcceleratorError`` from a cudaMalloc
  outside the caching allocator: context, cuBLAS workspace, NCCL) and ``CUBLAS_STATUS_ALLOC_FAILED`` /
  ``CUDNN_STATUS_ALLOC_FAILED``: memory ran out, the allocator's numbers are unknown;
- CPU: a plain ``RuntimeError`` ``... DefaultCPUAllocator: can't allocate memory: you tried to allocate
  1152921504606846976 bytes. Error code 12 (Cannot allocate memory)`` (or "not enough memory").
- ROCm: the same caching allocator, hipified: ``HIP out of memory. Tried to allocate ...`` in either
  CUDA wording above (the device is ``torch.cuda``'s ordinal there too), ``HIP error: out of memory``;
- XPU: ``XPU out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 15.11 GiB. Of the
  allocated memory ...`` (an ``xpu`` device; "of which ... is free" where the runtime says it).
``Storage size calculation overflowed`` is a shape error, not an allocation failure: not an OOM here.
One classifier serves the OOM reports, ``oom_guard`` and ``find_batch_size``.
"""

from __future__ import annotations

import re

from gpumemd.records.device import Device
from gpumemd.records.oom import OomMessage

# Bounded digit runs, never preceded by another digit: a message is outside input (a user's exception
# can say anything), and ``\d+`` without a literal prefix makes ``search`` quadratic on a long digit
# run. Real sizes have at most ~20 digits.
_SIZE = r"(?<![\d.])(\d{1,20}(?:\.\d{1,6})?) (bytes|KiB|MiB|GiB|TiB)"
_NEW = re.compile(
    r"(?:CUDA|HIP) out of memory\. Tried to allocate " + _SIZE + r"\. GPU (\d+) has a total capac(?:i)?ty of "
    + _SIZE + r" of which " + _SIZE + r" is free\."
)
_OLD = re.compile(
    r"(?:CUDA|HIP) out of memory\. Tried to allocate " + _SIZE + r" \(GPU (\d+); " + _SIZE + r" total capacity; "
    + _SIZE + r" already allocated; " + _SIZE + r" free; (?:" + _SIZE + r" allowed; )?" + _SIZE
    + r" reserved in total by PyTorch\)"
)
_ASYNC = re.compile(r"Allocation on device (\d{1,6}) would exceed allowed memory\. \(out of memory\)")
_ASYNC_LINES = {
    "allocated": re.compile(r"Currently allocated\s*: " + _SIZE),
    "requested": re.compile(r"Requested\s*: " + _SIZE),
    "total": re.compile(r"Device limit\s*: " + _SIZE),
    "free": re.compile(r"Free \(according to CUDA\)\s*: " + _SIZE),
    "limit": re.compile(r"PyTorch limit \(set by user-supplied memory fraction\)\s*: " + _SIZE),
}
_RUNTIME = re.compile(r"(?:CUDA|HIP) error: out of memory|(?:CUBLAS|CUDNN|HIPBLAS|MIOPEN)_STATUS_ALLOC_FAILED")
_XPU = re.compile(
    r"XPU out of memory\. Tried to allocate " + _SIZE + r"\. GPU (\d+) has a total capac(?:i)?ty of " + _SIZE
    + r"(?: of which " + _SIZE + r" is free)?\."
)
_PT = re.compile(
    r"Of the allocated memory " + _SIZE + r" is allocated by PyTorch, (?:with " + _SIZE
    + r" allocated in private pools \(e\.g\., CUDA Graphs\), )?and " + _SIZE
    + r" is reserved by PyTorch but unallocated"
)
_PROCESS = re.compile(r"this process has " + _SIZE + r" memory in use")
_ALLOWED = re.compile(_SIZE + r" allowed; ")
_CPU = re.compile(r"DefaultCPUAllocator: (?:can't allocate memory|not enough memory): you tried to allocate "
                  r"(\d{1,25}) bytes")
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
            device=Device.cuda(int(m[3])),
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
        reserved = parse_size(m[12], m[13])
        return OomMessage(
            kind="cuda",
            format="cuda-legacy",
            requested_bytes=parse_size(m[1], m[2]),
            device=Device.cuda(int(m[3])),
            total_bytes=parse_size(m[4], m[5]),
            free_bytes=parse_size(m[8], m[9]),
            allowed_bytes=parse_size(m[10], m[11]) if m[10] else None,
            allocated_bytes=allocated,
            reserved_bytes=reserved,
            reserved_unallocated_bytes=max(0, reserved - allocated),
        )
    if m := _ASYNC.search(text):
        return _async_message(Device.cuda(int(m[1])), text)
    if m := _XPU.search(text):
        return _xpu_message(m, text)
    if m := _CPU.search(text):
        return OomMessage(kind="cpu", format="cpu", requested_bytes=int(m[1]))
    if _MPS.search(text):
        size = _MPS_SIZE.search(text)
        return OomMessage(kind="mps", format="mps", requested_bytes=parse_size(size[1], size[2]) if size else None)
    if "CUDA out of memory" in text or "HIP out of memory" in text:  # a future wording: numbers unknown
        return OomMessage(kind="cuda", format="unparsed")
    if _RUNTIME.search(text):
        return OomMessage(kind="cuda", format="cuda-runtime")
    return None


def _async_message(device: Device, text: str) -> OomMessage:
    """CudaMallocAsync's message. Its "Currently allocated" is what PyTorch holds from the pool (that
    backend keeps no separate cache), and the memory-fraction limit, when one was set, is the cap."""
    sizes = {name: parse_size(m[1], m[2]) for name, pattern in _ASYNC_LINES.items() if (m := pattern.search(text))}
    total, limit = sizes.get("total"), sizes.get("limit")
    return OomMessage(
        kind="cuda",
        format="cuda-async",
        requested_bytes=sizes.get("requested"),
        device=device,
        total_bytes=total,
        free_bytes=sizes.get("free"),
        # With no fraction set the limit is SIZE_MAX ("17179869184.00 GiB"): no cap to report.
        allowed_bytes=limit if limit is not None and (total is None or limit < total) else None,
        allocated_bytes=sizes.get("allocated"),
    )


def _xpu_message(m: re.Match[str], text: str) -> OomMessage:
    """XPU's caching allocator: the request, the device total, what PyTorch holds and caches."""
    pt = _PT.search(text)  # the same sentence as CUDA's, never with private pools
    return OomMessage(
        kind="device",
        format="xpu",
        requested_bytes=parse_size(m[1], m[2]),
        device=Device("xpu", int(m[3])),
        total_bytes=parse_size(m[4], m[5]),
        free_bytes=parse_size(m[6], m[7]) if m[6] else None,
        allocated_bytes=parse_size(pt[1], pt[2]) if pt else None,
        reserved_unallocated_bytes=parse_size(pt[5], pt[6]) if pt else None,
        reserved_bytes=(parse_size(pt[1], pt[2]) + parse_size(pt[5], pt[6])) if pt else None,
    )


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
    message (torch < 1.13, TorchScript), a CPU allocation failure, an MPS OOM, and a CUDA runtime or
    library allocation failure (``torch.AcceleratorError`` "CUDA error: out of memory", cuBLAS/cuDNN
    ``*_STATUS_ALLOC_FAILED``). Shape overflows (``Storage size calculation overflowed``) and other
    accelerator errors (illegal address, launch failure) are not.
    """
    text = str(exc)
    if _is_torch_oom_class(exc):
        return parse_oom_message(text) or OomMessage(kind="device", format="unparsed")
    if not isinstance(exc, RuntimeError) or "Storage size calculation overflowed" in text:
        return None
    return parse_oom_message(text)
