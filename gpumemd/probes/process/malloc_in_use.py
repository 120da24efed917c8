"""The bytes the C heap has handed out and not taken back (glibc's ``mallinfo2``): what tells heap
fragmentation from a host leak.

A job whose tensors churn (a ``deque(maxlen=N)`` of each step's outputs, freed as new ones come) can
grow its RSS by tens of MiB after the deque is full, at random from run to run: freed chunks sit
between live ones and the heap's arena grows. Nothing is leaked: what malloc has handed out stays
flat. A leak, in a C extension or in Python objects larger than pymalloc's 512 bytes, grows it. One call
walks the arenas' bins (~0.5 µs on a small heap, 4.7 ms on one of ~100k free chunks), so it is read at
the start of the leak evaluations while host RSS rises, within the heap looks' share of
the budget, and at host RSS's culprit searches (``components.leak_host``), never at steps.
None where the C library has no ``mallinfo2`` (musl, macOS, glibc before 2.33).
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable

_FIELDS = ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in _FIELDS]


@functools.cache
def _mallinfo2() -> Callable[[], _Mallinfo2] | None:
    try:
        function = ctypes.CDLL(None).mallinfo2
    except (OSError, AttributeError):
        return None
    function.restype = _Mallinfo2
    function.argtypes = []
    return function


def malloc_in_use() -> int | None:
    """Bytes in use from malloc: in its arenas (``uordblks``) and in chunks it mapped on their own
    (``hblkhd``); None without ``mallinfo2``."""
    function = _mallinfo2()
    if function is None:
        return None
    info = function()
    return int(info.uordblks + info.hblkhd)
