"""Pass 2 of loading a snapshot: build the objects through an unpickler that calls nothing but charged
constructors for the few globals ``snapshot_rules`` admits (the opcodes were checked by the prescan).
"""

from __future__ import annotations

import gc
import io
import pickle
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from gpumemd.probes.snapshots.snapshot_rules import PY2_MODULES, Limits, SnapshotLoadError, refused_global


def _hash_cost(item: Any, limit: int) -> int:
    """What hashing ``item`` as a set member costs, in the prescan's terms (0: cheap, collision-proof)."""
    kind = type(item)
    if kind in (str, bytes, bool, type(None)) or (kind is int and -(2**63) <= item < 2**63):
        return 0
    if kind in (int, float, complex):
        return 1
    if kind is frozenset:  # its hash is cached, but comparing two that collide walks them
        return 1 + len(item)
    if kind is not tuple:  # list, dict, set: they refuse to be hashed at once
        return 0
    nodes, pending = 0, [item]
    while pending and nodes <= limit:
        nodes += 1
        for sub in pending.pop():
            if type(sub) is tuple:
                pending.append(sub)
            else:
                nodes += 1
    return nodes


class _RestrictedUnpickler(pickle.Unpickler):
    """Calls nothing but the wrappers below, one per entry of ALLOWED_GLOBALS. Each accepts only the
    arguments pickle writes for its type, and charges what it copies: a memo reference passes the same
    argument again for two bytes, so ``set(big_list)`` a thousand times, or ``bytearray(2**40)``, would
    otherwise build far more than the file holds."""

    def __init__(self, file: io.BytesIO, limits: Limits, nbytes: int) -> None:
        super().__init__(file)
        self._limits = limits
        self._copy_left = limits.copy_budget(nbytes)
        self._hashed = 0
        self._constructors: dict[tuple[str, str], Callable[..., Any]] = {
            ("builtins", "set"): self._set, ("builtins", "frozenset"): self._frozenset,
            ("builtins", "bytearray"): self._bytearray, ("builtins", "bytes"): _empty_bytes,
            ("_codecs", "encode"): self._latin1, ("builtins", "complex"): _complex,
            ("collections", "OrderedDict"): _ordered_dict,
        }

    def find_class(self, module: str, name: str) -> Any:
        constructor = self._constructors.get((PY2_MODULES.get(module, module), name))
        if constructor is None:
            raise refused_global(module, name)
        return constructor

    def _charge(self, elements: int, what: str) -> None:
        self._copy_left -= elements
        if self._copy_left < 0:
            raise SnapshotLoadError(
                f"refused {what}: set(), frozenset() and bytearray() would copy more than "
                f"{self._limits.copy_elements_per_byte} elements per byte of the file (at least "
                f"{self._limits.min_copy_elements}) in all; a pickle writes each element once"
            )

    def _members(self, items: Any, what: str) -> list[Any]:
        # pickle writes set(x) as set([...]) (protocols 2-3); 4+ use EMPTY_SET/FROZENSET, no call at all
        if type(items) is not list:
            raise SnapshotLoadError(f"refused {what}({type(items).__name__}): pickle writes a list there")
        self._charge(len(items), f"{what}() of {len(items)} items")
        limit = self._limits.max_hashed_nodes
        for item in items:
            self._hashed += _hash_cost(item, limit)
            if self._hashed > limit:
                raise SnapshotLoadError(f"refused {what}(): hashing its members would walk more than {limit} "
                                        "tuple/float/big-int objects")
        return items

    def _set(self, items: Any = None) -> set[Any]:
        return set() if items is None else set(self._members(items, "set"))

    def _frozenset(self, items: Any = None) -> frozenset[Any]:
        return frozenset() if items is None else frozenset(self._members(items, "frozenset"))

    def _bytearray(self, data: Any = b"") -> bytearray:
        # pickle writes bytearray(b"...") (protocols 2-4; 5 has BYTEARRAY8); bytearray(n) allocates n bytes
        if type(data) is not bytes:
            raise SnapshotLoadError(f"refused bytearray({type(data).__name__}): pickle writes it from bytes, "
                                    "and bytearray(n) would allocate n bytes from a 5-byte argument")
        self._charge(len(data), f"bytearray() of {len(data)} bytes")
        return bytearray(data)

    def _latin1(self, text: Any, encoding: Any) -> bytes:
        # protocol 2's bytes: _codecs.encode(text, "latin1"); other codecs (zlib, base64...) are no bytes
        if type(text) is not str or encoding != "latin1":
            raise SnapshotLoadError("refused _codecs.encode() of anything but text to latin1 (how protocol 2 "
                                    "writes bytes)")
        self._charge(len(text), f"_codecs.encode() of {len(text)} characters")
        return text.encode("latin1")


def _empty_bytes() -> bytes:
    return b""  # protocol 2's b"": bytes(); bytes(n) would allocate n bytes, so it takes no argument


def _complex(real: Any = 0.0, imag: Any = 0.0) -> complex:
    if type(real) not in (int, float) or type(imag) not in (int, float):
        raise SnapshotLoadError("refused complex() of anything but two numbers (pickle writes two floats)")
    return complex(real, imag)


def _ordered_dict(*args: Any) -> OrderedDict[Any, Any]:
    if args:  # pickle writes OrderedDict() and then SETITEMS
        raise SnapshotLoadError("refused OrderedDict() with arguments: pickle writes an empty one, then its items")
    return OrderedDict()


def unpickle(data: bytes, limits: Limits) -> Any:
    # The cyclic GC would rescan the growing heap again and again (a 17 MB snapshot loads in 1.5 s with
    # it, 0.4 s without), and what pickle builds here has no garbage cycles to find.
    enabled = gc.isenabled()
    gc.disable()
    try:
        return _RestrictedUnpickler(io.BytesIO(data), limits, len(data)).load()
    finally:
        if enabled:
            gc.enable()
