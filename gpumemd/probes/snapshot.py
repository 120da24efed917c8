"""The CUDA allocator's own view: snapshots, allocation history, ``memory_summary`` and the OOM observer.

Everything goes through ``SnapshotProbe`` (seam: ``torch_module``), which never raises: on a CPU build
every call here is an AttributeError or AssertionError (TORCH_MEMORY_API.md §5), reported once as absent.

Loading a snapshot someone sent you is the other half: ``load_snapshot`` uses a restricted unpickler
that admits builtin containers and scalars only, so a crafted ``snapshot.pickle`` cannot run code, and
bounds what it may build (file size, memo indexes, copies, hashing, nesting, shared references), so a
crafted one cannot exhaust memory or time either.
"""

from __future__ import annotations

import gc
import io
import os
import pickle
import pickletools
import stat
from array import array
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gpumemd.probes.allocation_history import AllocationHistory, process_history
from gpumemd.probes.health import ProbeHealth

OomObserver = Callable[[int, int, int, int], None]
_HISTORY_USER = "oom"  # this probe's name among the users of the allocation history


class SnapshotProbe:
    """Reads the CUDA caching allocator's state; only ever after the job itself initialised CUDA."""

    def __init__(self, torch_module: Any = None, history: AllocationHistory | None = None) -> None:
        self.health = ProbeHealth("snapshot")
        self._torch = torch_module
        self.history_enabled = False
        # The real torch shares the process's one history owner; a fake torch (tests) gets its own.
        self._history = history or (process_history() if torch_module is None else AllocationHistory(torch_module))

    def _t(self) -> Any:
        if self._torch is None:
            import torch

            self._torch = torch
        return self._torch

    def cuda_available(self) -> bool:
        """False where CUDA can never come up in this process (a CPU build, no device)."""
        try:
            # device_count(), not is_available(): NVML-based before CUDA is up, so fork stays safe
            torch = self._t()
            if getattr(torch.version, "cuda", None) is None and getattr(torch.version, "hip", None) is None:
                return False
            return int(torch.cuda.device_count()) > 0
        except Exception as exc:  # noqa: BLE001 - a probe never raises into the job
            self.health.failed(exc)
            return False

    def cuda_initialized(self) -> bool:
        """True once the job has initialised CUDA (never initialises it)."""
        try:
            return bool(self._t().cuda.is_initialized())
        except Exception as exc:  # noqa: BLE001 - a probe never raises into the job
            self.health.failed(exc)
            return False

    def capture(self) -> dict[str, Any] | None:
        """``torch.cuda.memory._snapshot()`` (all devices), or None when there is no CUDA allocator."""
        if not self.cuda_initialized():
            return None
        try:
            snapshot = self._t().cuda.memory._snapshot()
        except Exception as exc:  # noqa: BLE001 - cudaMallocAsync raises RuntimeError, CPU AttributeError
            self.health.failed(exc)
            return None
        self.health.ok()
        return snapshot if isinstance(snapshot, dict) else None

    def memory_summary(self, device: int) -> str | None:
        """``torch.cuda.memory_summary(device)`` text, or None without CUDA."""
        if not self.cuda_initialized():
            return None
        try:
            return str(self._t().cuda.memory_summary(device))
        except Exception as exc:  # noqa: BLE001 - KeyError on CPU builds, RuntimeError elsewhere
            self.health.failed(exc)
            return None

    def enable_history(self, max_entries: int) -> bool:
        """Record allocation history with Python stacks in a ring buffer of ``max_entries``, through
        the process's one ``AllocationHistory`` (a recording the job switched on is used as it is).

        Costs about 2 µs per allocation and several KB per entry (PyTorch's docstring), hence off by
        default. Feature-detected: the string API (2.1+), else the legacy boolean one.
        """
        if not self.cuda_initialized():
            return False
        if not self._history.acquire(_HISTORY_USER, max_entries):
            self.health.absent("allocation history cannot be recorded here (cudaMallocAsync or an old torch)")
            return False
        self.history_enabled = True
        return True

    def disable_history(self) -> None:
        """This probe no longer needs history: switched off only if gpumemd switched it on and no other
        part of gpumemd still uses it."""
        if not self.history_enabled:
            return
        self.history_enabled = False
        self._history.release(_HISTORY_USER)

    def attach_oom_observer(self, observer: OomObserver) -> bool:
        """Register ``observer`` with the CUDA allocator. It initialises CUDA: call it only once
        ``cuda_initialized()``. There is no way to remove it again (PyTorch has no detach)."""
        if not self.cuda_initialized():
            return False
        attach = getattr(self._t()._C, "_cuda_attach_out_of_memory_observer", None)
        if attach is None:
            self.health.absent("this torch has no CUDA out-of-memory observer (CPU build or torch < 2.0)")
            return False
        try:
            attach(observer)
        except Exception as exc:  # noqa: BLE001 - cudaMallocAsync / pluggable allocators raise
            self.health.failed(exc)
            return False
        return True


# --- loading snapshots safely ------------------------------------------------------------------
#
# A snapshot someone sent is untrusted input: the restricted unpickler stops it running code, and the
# bounds below stop it exhausting memory, time or the C stack. Two passes, each linear in the file:
# _prescan reads every opcode and builds nothing (it tracks what the unpickler would build: memo
# indexes, each container's size and nesting, what gets hashed), then the C unpickler builds the
# objects, calling only the wrappers in _RestrictedUnpickler, which charge what they copy.

# The biggest real snapshots (a long job's history with Python and C++ stacks) are hundreds of MB; 2 GiB
# leaves headroom, and the loaded objects take several times the file in RAM anyway. Every opcode is at
# least one byte, so this caps the opcode count too; the limits that grow with the file are per byte.
_MAX_SNAPSHOT_BYTES = 2 * 2**30
# A memo reference (BINGET) costs 2 bytes however big its object: PyTorch shares each frame dict between
# all tracebacks and one traceback list between a block's alloc and free events, and a crafted file puts
# a list into a list 1000 times per level. Counting each object every time a walker (json.dumps, ==, a
# summary) reaches it, a real snapshot is a few objects per byte of pickle; 64 admits it with room to
# spare, while a structure that multiplies per level passes any such bound within a few dozen levels.
_TREE_NODES_PER_BYTE = 64
_MIN_TREE_NODES = 2**20  # small files: a million objects still walk in well under a second
# A real snapshot nests about 7 deep (snapshot > segments > segment > blocks > block > frames > frame);
# recursive walkers give up near 1000, and only a crafted file nests deeper.
_MAX_DEPTH = 100
# set(), frozenset() and bytearray() copy their argument, which a memo reference passes again for 2
# bytes: a pickle writes each element once, so 4 copied elements per byte of file is ample.
_COPY_ELEMENTS_PER_BYTE = 4
_MIN_COPY_ELEMENTS = 2**20
# Hashing (dict keys, set members) is where a few bytes get leverage: a tuple's hash is not cached and
# walks all of it (tuples of shared tuples double per level; a deep one overflows the C stack, and
# CPython 3.11 segfaults), and floats, ints past 2**63 and tuples hash predictably enough to collide on
# purpose (quadratic inserts). str and bytes hashes are randomised and an int below 2**63 shares its hash
# with at most a few others: those are free. Snapshots key everything with str, so the rest (tuples,
# frozensets, floats, complex, big ints) get this many objects in all.
_MAX_HASHED_NODES = 4096


@dataclass(frozen=True)
class _Limits:
    """The bounds above; tests pass small ones (a 2 GiB file is no unit-test input)."""

    max_bytes: int = _MAX_SNAPSHOT_BYTES
    tree_nodes_per_byte: int = _TREE_NODES_PER_BYTE
    min_tree_nodes: int = _MIN_TREE_NODES
    max_depth: int = _MAX_DEPTH
    copy_elements_per_byte: int = _COPY_ELEMENTS_PER_BYTE
    min_copy_elements: int = _MIN_COPY_ELEMENTS
    max_hashed_nodes: int = _MAX_HASHED_NODES

    def tree_budget(self, nbytes: int) -> int:
        return max(self.min_tree_nodes, self.tree_nodes_per_byte * nbytes)

    def copy_budget(self, nbytes: int) -> int:
        return max(self.min_copy_elements, self.copy_elements_per_byte * nbytes)


_DEFAULT_LIMITS = _Limits()

# A real snapshot holds only dict/list/tuple/int/float/str/bool/None, which pickle encodes without any
# global. These harmless constructors are admitted for snapshots other tools re-saved; protocol 2 writes
# bytes and bytearray through _codecs.encode(text, "latin1") and bytes().
_ALLOWED_GLOBALS: frozenset[tuple[str, str]] = frozenset({
    ("builtins", "set"), ("builtins", "frozenset"), ("builtins", "bytearray"), ("builtins", "bytes"),
    ("builtins", "complex"), ("collections", "OrderedDict"), ("_codecs", "encode"),
})
# Protocols 0-2 write Python 2's module name (fix_imports); the C unpickler maps it back only in the
# find_class we override.
_PY2_MODULES = {"__builtin__": "builtins"}


class SnapshotLoadError(ValueError):
    """A snapshot that is truncated, not a pickle, not a snapshot, too big, or that tries to load code."""


def _refused_global(module: str, name: str) -> SnapshotLoadError:
    return SnapshotLoadError(
        f"refused to load {module}.{name}: a snapshot may hold only builtin containers and scalars "
        "(this file was not written by PyTorch, or was tampered with)"
    )


# --- pass 1: the opcodes ------------------------------------------------------------------------

# What each opcode a snapshot may use does to the unpickler's stack; _prescan mirrors exactly that.
(_PUSH, _NEW, _LONG1, _GET, _PUT, _MEMOIZE, _MARK, _APPEND, _APPENDS, _SETITEM, _SETITEMS, _ADDITEMS,
 _FROZENSET, _TUPLE_N, _TUPLE, _POP, _POP_MARK, _GLOBAL, _STACK_GLOBAL, _REDUCE, _NOOP, _STOP) = range(22)

# _prescan's stack and memo hold one int per object, its record: 0 for a scalar whose hash is cheap and
# collision-proof (str, bytes, bool, None, an int below 2**63); 1 for a scalar whose hash can be aimed
# (float, a bigger int); -2 - i for container number i in _Containers, which also knows whether hashing
# it walks it. A bytearray is a scalar: it holds no references.
_AIMABLE = 1

# Protocols 2-5 write builtin containers and scalars, and the allowlisted constructors, with these and
# no others: no protocol-0 text opcodes, no EXT*/PERSID/INST/OBJ/NEWOBJ/BUILD (no allowlisted type needs
# them), no out-of-band buffers, no LONG4 (an int past 255 bytes: never a size or an address).
# name -> (effect, record pushed, tuple arity)
_SNAPSHOT_OPCODES: dict[str, tuple[int, int, int]] = {
    "PROTO": (_NOOP, 0, 0), "FRAME": (_NOOP, 0, 0), "STOP": (_STOP, 0, 0),
    "MARK": (_MARK, 0, 0), "POP": (_POP, 0, 0), "POP_MARK": (_POP_MARK, 0, 0),
    "NONE": (_PUSH, 0, 0), "NEWTRUE": (_PUSH, 0, 0), "NEWFALSE": (_PUSH, 0, 0),
    "BININT": (_PUSH, 0, 0), "BININT1": (_PUSH, 0, 0), "BININT2": (_PUSH, 0, 0), "LONG1": (_LONG1, 0, 0),
    "BINFLOAT": (_PUSH, _AIMABLE, 0),
    "SHORT_BINUNICODE": (_PUSH, 0, 0), "BINUNICODE": (_PUSH, 0, 0), "BINUNICODE8": (_PUSH, 0, 0),
    "SHORT_BINBYTES": (_PUSH, 0, 0), "BINBYTES": (_PUSH, 0, 0), "BINBYTES8": (_PUSH, 0, 0),
    "BYTEARRAY8": (_PUSH, 0, 0),
    "EMPTY_LIST": (_NEW, 0, 0), "APPEND": (_APPEND, 0, 0), "APPENDS": (_APPENDS, 0, 0),
    "EMPTY_DICT": (_NEW, 0, 0), "SETITEM": (_SETITEM, 0, 0), "SETITEMS": (_SETITEMS, 0, 0),
    "EMPTY_SET": (_NEW, 0, 0), "ADDITEMS": (_ADDITEMS, 0, 0), "FROZENSET": (_FROZENSET, 0, 0),
    "EMPTY_TUPLE": (_TUPLE_N, 0, 0), "TUPLE1": (_TUPLE_N, 0, 1), "TUPLE2": (_TUPLE_N, 0, 2),
    "TUPLE3": (_TUPLE_N, 0, 3), "TUPLE": (_TUPLE, 0, 0),
    "BINPUT": (_PUT, 0, 0), "LONG_BINPUT": (_PUT, 0, 0), "MEMOIZE": (_MEMOIZE, 0, 0),
    "BINGET": (_GET, 0, 0), "LONG_BINGET": (_GET, 0, 0),
    "GLOBAL": (_GLOBAL, 0, 0), "STACK_GLOBAL": (_STACK_GLOBAL, 0, 0), "REDUCE": (_REDUCE, 0, 0),
}

# pickletools' own description of each argument: a fixed width, or a length prefix of 1, 4 or 8 bytes.
_LENGTH_PREFIX = {pickletools.TAKEN_FROM_ARGUMENT1: 1, pickletools.TAKEN_FROM_ARGUMENT4U: 4,
                  pickletools.TAKEN_FROM_ARGUMENT8U: 8}


def _opcode_table() -> list[tuple[int, int, int, int, int] | None]:
    """Byte -> (effect, fixed argument width, length-prefix width, record, tuple arity), or None."""
    table: list[tuple[int, int, int, int, int] | None] = [None] * 256
    for op in pickletools.opcodes:
        if op.name not in _SNAPSHOT_OPCODES:
            continue
        effect, record, arity = _SNAPSHOT_OPCODES[op.name]
        n = op.arg.n if op.arg is not None else 0
        width, prefix = (n, 0) if n >= 0 else (0, _LENGTH_PREFIX.get(n, 0))
        if n < 0 and not prefix and effect != _GLOBAL:
            raise AssertionError(f"{op.name}: argument layout {n} is not handled")
        table[ord(op.code)] = (effect, width, prefix, record, arity)
    return table


_OPCODE_TABLE = _opcode_table()
_OPCODE_NAMES = {ord(op.code): op.name for op in pickletools.opcodes}
_BINGET, _MARK_CODE, _MEMOIZE_CODE = ord(pickle.BINGET), ord(pickle.MARK), ord(pickle.MEMOIZE)


def _opcode_refused(code: int, at: int) -> SnapshotLoadError:
    name = _OPCODE_NAMES.get(code)
    what = f"opcode {name}" if name is not None else f"byte 0x{code:02x} (not a pickle opcode)"
    return SnapshotLoadError(f"refused {what} at byte {at}: a snapshot pickle holds only builtin containers "
                             "and scalars (protocols 2-5); this file was not written by PyTorch, or is damaged")


def _truncated(at: int) -> SnapshotLoadError:
    return SnapshotLoadError(f"not a readable pickle: the opcode at byte {at} runs past the end; truncated?")


def _malformed(what: str, at: int) -> SnapshotLoadError:
    return SnapshotLoadError(f"not a readable pickle: {what} at byte {at}")


def _read_global(data: bytes, pos: int) -> tuple[str, str, int]:
    """GLOBAL's "module\\nname\\n" argument from ``pos``: module, name and the position after it."""
    mid = data.find(b"\n", pos, pos + 256)
    end = data.find(b"\n", mid + 1, mid + 257) if mid >= 0 else -1
    if end < 0:
        raise _malformed("a GLOBAL without two short newline-terminated names", pos - 1)
    module, name = data[pos:mid].decode("utf-8", "replace"), data[mid + 1:end].decode("utf-8", "replace")
    return module, name, end + 1


# Container flags: hashable (a tuple or frozenset, or what a constructor returned: it may be one, and
# hashing it walks it); placed (already inside another container).
_HASHABLE, _PLACED = 1, 2


class _Containers:
    """The containers the unpickler would build, by number: each one's size (objects in it, counting a
    shared one each time a walker reaches it), height and flags. Sizes are final when a container is
    placed in another, because a pickler never adds to one after that (only a cycle needs it, and we
    refuse those): so the sizes sum up exactly, in time linear in the file, however much is shared."""

    def __init__(self, limits: _Limits, nbytes: int) -> None:
        self.size = array("q")
        self.height = bytearray()
        self.flags = bytearray()
        self.budget = limits.tree_budget(nbytes)
        self.max_depth = limits.max_depth
        self.max_hashed = limits.max_hashed_nodes
        self.hashed = 0

    def new(self, kind: int = 0, size: int = 1, height: int = 1) -> int:
        """A new container's record."""
        if size > self.budget:
            raise self._too_many()
        if height > self.max_depth:
            raise SnapshotLoadError(f"refused containers nested more than {self.max_depth} deep: a real snapshot "
                                    "nests about 7")
        self.size.append(size)
        self.height.append(height)
        self.flags.append(kind)
        return -1 - len(self.size)

    def _too_many(self) -> SnapshotLoadError:
        return SnapshotLoadError(f"refused a snapshot of more than {self.budget} objects as a walker counts them "
                                 "(each shared one every time it is reached): shared references that multiply, "
                                 "which PyTorch never writes")

    def place(self, items: list[int]) -> tuple[int, int]:
        """Size and height of ``items`` together, which go into a container now."""
        if not items or min(items) >= 0:  # scalars only: one object each
            return len(items), 0
        size, height = 0, 0
        for record in items:
            if record >= 0:
                size += 1
                continue
            i = -2 - record
            size += self.size[i]
            height = max(height, self.height[i])
            self.flags[i] |= _PLACED
        return size, height

    def add(self, target: int, items: list[int], at: int) -> None:
        """APPEND(S), SETITEM(S), ADDITEMS: ``items`` go into ``target``."""
        if target >= 0:  # not a container: the unpickler fails, or it is a bytearray (still a leaf)
            return
        i = -2 - target
        if self.flags[i] & _PLACED:
            raise SnapshotLoadError(f"refused at byte {at}: a container is added to after it was placed in another "
                                    "(only a reference cycle needs that, and a snapshot has none)")
        if target in items:
            raise SnapshotLoadError(f"refused at byte {at}: a container placed in itself (a reference cycle)")
        size, height = self.place(items)
        self.size[i] += size
        if self.size[i] > self.budget:
            raise self._too_many()
        if height >= self.height[i]:
            if height >= self.max_depth:
                raise SnapshotLoadError(f"refused containers nested more than {self.max_depth} deep: a real "
                                        "snapshot nests about 7")
            self.height[i] = height + 1

    def build(self, items: list[int]) -> int:
        """TUPLE*, FROZENSET, REDUCE: a new (hashable) container made of ``items``."""
        size, height = self.place(items)
        return self.new(_HASHABLE, 1 + size, 1 + height)

    def hash(self, records: list[int], at: int) -> None:
        """Charge hashing these as dict keys or set members (lists, dicts, sets refuse to hash at once)."""
        for record in records:
            if record > 0:
                self.hashed += record
            elif record < 0 and self.flags[-2 - record] & _HASHABLE:
                self.hashed += self.size[-2 - record]
        if self.hashed > self.max_hashed:
            raise SnapshotLoadError(f"refused at byte {at}: hashing its dict keys and set members would walk more "
                                    f"than {self.max_hashed} tuple/float/big-int objects (a snapshot keys its dicts "
                                    "with strings)")


def _prescan(data: bytes, limits: _Limits) -> int:
    """Read every opcode without building anything, and refuse: opcodes outside _SNAPSHOT_OPCODES, globals
    outside _ALLOWED_GLOBALS, memo indexes out of sequence, lengths past the end, and anything past the
    limits _Containers keeps (objects, nesting, hashing). It mirrors the C unpickler's stack and marks,
    one record per object. One loop, hot opcodes first: a big snapshot has tens of millions. Returns the
    size of what the pickle builds (objects, as a walker counts them; tests compare it with one)."""
    table, end, from_bytes = _OPCODE_TABLE, len(data), int.from_bytes
    containers = _Containers(limits, end)
    new_size, new_height, new_flags = containers.size.append, containers.height.append, containers.flags.append
    stack: list[int] = []
    push = stack.append
    marks: list[int] = []
    fence = 0  # items below the innermost MARK are out of reach, as in the unpickler
    memo = array("q")  # pickle numbers memo entries 0, 1, 2...: an index past len(memo) is never legitimate
    pos = 0
    while True:
        if pos >= end:
            raise SnapshotLoadError("not a readable pickle: it ends before its STOP opcode; truncated?")
        at, code = pos, data[pos]
        # BINGET, MARK and MEMOIZE are two thirds of a real snapshot's opcodes: handled before the table
        # (MARK only here; the other two fall through to it for the error message)
        if code == _BINGET and pos + 1 < end and data[pos + 1] < len(memo):
            push(memo[data[pos + 1]])
            pos += 2
            continue
        if code == _MARK_CODE:
            marks.append(len(stack))
            fence = len(stack)
            pos += 1
            continue
        if code == _MEMOIZE_CODE and len(stack) > fence:
            memo.append(stack[-1])
            pos += 1
            continue
        entry = table[code]
        if entry is None:
            raise _opcode_refused(code, at)
        effect, width, prefix, record, arity = entry
        pos += 1
        if prefix:
            if pos + prefix > end:
                raise _truncated(at)
            length = data[pos] if prefix == 1 else from_bytes(data[pos:pos + prefix], "little")
            pos += prefix
            if length > end - pos:  # refused before the unpickler preallocates `length` bytes
                raise SnapshotLoadError(f"not a readable pickle: the {length}-byte argument at byte {at} is "
                                        f"longer than the {end - pos} bytes left; truncated?")
            pos += length
        elif width:
            pos += width
            if pos > end:
                raise _truncated(at)
        if effect == _GET:
            index = data[at + 1] if width == 1 else from_bytes(data[at + 1:pos], "little")
            if index >= len(memo):
                raise SnapshotLoadError(f"refused memo index {index} at byte {at}: only {len(memo)} objects were "
                                        "stored so far, and pickle numbers them in order")
            stack.append(memo[index])
        elif effect == _PUSH:
            stack.append(record)
        elif effect in (_PUT, _MEMOIZE):
            index = len(memo) if effect == _MEMOIZE else (
                data[at + 1] if width == 1 else from_bytes(data[at + 1:pos], "little"))
            if len(stack) <= fence:
                raise _malformed("a memo store with nothing to store", at)
            if index < len(memo):
                memo[index] = stack[-1]
            elif index == len(memo):
                memo.append(stack[-1])
            else:
                raise SnapshotLoadError(f"refused memo index {index} at byte {at}: the next one in order is "
                                        f"{len(memo)} (an index sizes the unpickler's memo table)")
        elif effect == _NEW:  # an empty list, dict or set: containers.new(), inlined
            new_size(1)
            new_height(1)
            new_flags(0)
            push(-1 - len(containers.size))
        elif effect == _LONG1:
            stack.append(0 if length <= 8 else _AIMABLE)
        elif effect in (_APPENDS, _SETITEMS, _ADDITEMS, _FROZENSET, _TUPLE, _POP_MARK):
            if not marks:
                raise _malformed(f"{_OPCODE_NAMES[code]} without a MARK", at)
            mark = marks.pop()
            fence = marks[-1] if marks else 0
            items = stack[mark:]
            del stack[mark:]
            if effect in (_APPENDS, _SETITEMS, _ADDITEMS):
                if mark <= fence:
                    raise _malformed("items added to nothing", at)
                if effect == _SETITEMS and len(items) % 2:
                    raise _malformed("an odd number of items for SETITEMS", at)
                keys = items[::2] if effect == _SETITEMS else items if effect == _ADDITEMS else []
                if any(keys):
                    containers.hash(keys, at)
                containers.add(stack[-1], items, at)
            elif effect == _FROZENSET:
                if any(items):
                    containers.hash(items, at)
                stack.append(containers.build(items))
            elif effect == _TUPLE:
                stack.append(containers.build(items))
        elif effect == _SETITEM:
            if len(stack) - fence < 3:
                raise _malformed("SETITEM without a dict, key and value", at)
            if stack[-2]:
                containers.hash(stack[-2:-1], at)
            containers.add(stack[-3], stack[-2:], at)
            del stack[-2:]
        elif effect == _APPEND:
            if len(stack) - fence < 2:
                raise _malformed("APPEND without a list and an item", at)
            containers.add(stack[-2], stack[-1:], at)
            stack.pop()
        elif effect == _TUPLE_N:
            if len(stack) - fence < arity:
                raise _malformed("a tuple of more items than the stack holds", at)
            items = stack[len(stack) - arity:]
            del stack[len(stack) - arity:]
            stack.append(containers.build(items))
        elif effect == _POP:
            if marks and marks[-1] == len(stack):  # the unpickler's POP drops an empty MARK
                marks.pop()
                fence = marks[-1] if marks else 0
            elif len(stack) <= fence:
                raise _malformed("POP of an empty stack", at)
            else:
                stack.pop()
        elif effect == _GLOBAL:
            module, name, pos = _read_global(data, pos)
            if (_PY2_MODULES.get(module, module), name) not in _ALLOWED_GLOBALS:
                raise _refused_global(module, name)
            stack.append(0)
        elif effect in (_STACK_GLOBAL, _REDUCE):
            if len(stack) - fence < 2:
                raise _malformed(f"{_OPCODE_NAMES[code]} without its two operands", at)
            operands = stack[-2:]
            del stack[-2:]
            # a constructor's result holds at most what its arguments held (set(list) and the like)
            stack.append(0 if effect == _STACK_GLOBAL else containers.build(operands[1:]))
        elif effect == _STOP:
            if len(stack) <= fence:
                raise _malformed("STOP with nothing to return", at)
            return 1 if stack[-1] >= 0 else containers.size[-2 - stack[-1]]


# --- pass 2: building, through charged constructors ----------------------------------------------


def _hash_cost(item: Any, limit: int) -> int:
    """What hashing ``item`` as a set member costs in _Containers.hash's terms (0: cheap, collision-proof)."""
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
    """Calls nothing but the wrappers below, one per entry of _ALLOWED_GLOBALS. Each accepts only the
    arguments pickle writes for its type, and charges what it copies: a memo reference passes the same
    argument again for two bytes, so ``set(big_list)`` a thousand times, or ``bytearray(2**40)``, would
    otherwise build far more than the file holds."""

    def __init__(self, file: io.BytesIO, limits: _Limits, nbytes: int) -> None:
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
        constructor = self._constructors.get((_PY2_MODULES.get(module, module), name))
        if constructor is None:
            raise _refused_global(module, name)
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


def _unpickle(data: bytes, limits: _Limits) -> Any:
    # The cyclic GC would rescan the growing heap again and again (a 17 MB snapshot loads in 1.5 s with
    # it, 0.4 s without), and what pickle builds here has no garbage cycles to find.
    enabled = gc.isenabled()
    gc.disable()
    try:
        return _RestrictedUnpickler(io.BytesIO(data), limits, len(data)).load()
    finally:
        if enabled:
            gc.enable()


# --- the entry points -----------------------------------------------------------------------------


def _loads_snapshot(data: bytes, limits: _Limits) -> dict[str, Any] | list[Any]:
    if len(data) > limits.max_bytes:
        raise SnapshotLoadError(f"refused a {len(data)}-byte snapshot: over the {limits.max_bytes}-byte limit")
    try:
        _prescan(data, limits)
        obj = _unpickle(data, limits)
    except SnapshotLoadError:
        raise
    except RecursionError:
        raise SnapshotLoadError("refused: nested too deeply to load") from None
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, IndexError, KeyError,
            AttributeError, MemoryError, UnicodeDecodeError, OverflowError) as exc:
        raise SnapshotLoadError(f"not a readable pickle ({type(exc).__name__}: {exc}); truncated?") from None
    if isinstance(obj, dict) and isinstance(obj.get("segments"), list):
        return obj
    if isinstance(obj, list):
        return obj
    raise SnapshotLoadError(
        f"not a PyTorch memory snapshot: expected a dict with a 'segments' list, got {type(obj).__name__}"
    )


def loads_snapshot(data: bytes) -> dict[str, Any] | list[Any]:
    """Unpickle a snapshot without running code, in memory and time bounded by the file's size (see
    _Limits); the result is a dict (``_snapshot``) or a list. Anything else raises SnapshotLoadError."""
    return _loads_snapshot(bytes(data), _DEFAULT_LIMITS)


def _load_snapshot(path: str, limits: _Limits) -> dict[str, Any] | list[Any]:
    try:
        info = os.stat(path)
        if not stat.S_ISREG(info.st_mode):  # a FIFO blocks, /dev/zero never ends
            raise SnapshotLoadError(f"{path} is not a regular file")
        if info.st_size > limits.max_bytes:
            raise SnapshotLoadError(f"refused {path}: {info.st_size} bytes, over the {limits.max_bytes}-byte limit "
                                    "for a snapshot")
        with open(path, "rb") as f:
            data = f.read(limits.max_bytes + 1)  # a file that grew since stat is caught below
    except OSError as exc:
        raise SnapshotLoadError(f"cannot read {path}: {exc.strerror or exc}") from None
    return _loads_snapshot(data, limits)


def load_snapshot(path: str) -> dict[str, Any] | list[Any]:
    """Read and safely unpickle ``path`` (see ``loads_snapshot``); a file over 2 GiB is refused unread."""
    return _load_snapshot(path, _DEFAULT_LIMITS)
