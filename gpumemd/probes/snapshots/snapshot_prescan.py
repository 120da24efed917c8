"""Pass 1 of loading a snapshot: read every opcode of the pickle without building anything, and refuse
what a snapshot never holds or what would build more than the file's size allows (``snapshot_rules``).

It mirrors the C unpickler's stack, marks and memo with one integer record per object, and keeps the
containers the unpickler would build (size, nesting, what hashing them walks) in ``Containers``
(``snapshot_containers``).
"""

from __future__ import annotations

import pickle
import pickletools
from array import array
from collections.abc import Callable

from gpumemd.probes.snapshots.snapshot_containers import Containers
from gpumemd.probes.snapshots.snapshot_rules import (
    ALLOWED_GLOBALS,
    PY2_MODULES,
    BuildCost,
    Limits,
    SnapshotLoadError,
    refused_global,
)

# What each opcode a snapshot may use does to the unpickler's stack; prescan mirrors exactly that.
(_PUSH, _NEW, _LONG1, _GET, _PUT, _MEMOIZE, _MARK, _APPEND, _APPENDS, _SETITEM, _SETITEMS, _ADDITEMS,
 _FROZENSET, _TUPLE_N, _TUPLE, _POP, _POP_MARK, _GLOBAL, _STACK_GLOBAL, _REDUCE, _NOOP, _STOP) = range(22)

# prescan's stack and memo hold one int per object, its record: 0 for a scalar whose hash is cheap and
# collision-proof (str, bytes, bool, None, an int below 2**63); 1 for a scalar whose hash can be aimed
# (float, a bigger int); -2 - i for container number i in Containers, which also knows whether hashing
# it walks it. A bytearray is a scalar: it holds no references.
_AIMABLE = 1

# Protocols 2-5 write builtin containers and scalars, and the allowlisted constructors, with these and
# no others: no protocol-0 text opcodes, no EXT*/PERSID/INST/OBJ/NEWOBJ/BUILD (no allowlisted type needs
# them), no out-of-band buffers, no LONG4 (an int past 255 bytes: never a size or an address).
# name -> (effect, record pushed (for an empty container: what building it costs), tuple arity)
_SNAPSHOT_OPCODES: dict[str, tuple[int, int, int]] = {
    "PROTO": (_NOOP, 0, 0), "FRAME": (_NOOP, 0, 0), "STOP": (_STOP, 0, 0),
    "MARK": (_MARK, 0, 0), "POP": (_POP, 0, 0), "POP_MARK": (_POP_MARK, 0, 0),
    "NONE": (_PUSH, 0, 0), "NEWTRUE": (_PUSH, 0, 0), "NEWFALSE": (_PUSH, 0, 0),
    "BININT": (_PUSH, 0, 0), "BININT1": (_PUSH, 0, 0), "BININT2": (_PUSH, 0, 0), "LONG1": (_LONG1, 0, 0),
    "BINFLOAT": (_PUSH, _AIMABLE, 0),
    "SHORT_BINUNICODE": (_PUSH, 0, 0), "BINUNICODE": (_PUSH, 0, 0), "BINUNICODE8": (_PUSH, 0, 0),
    "SHORT_BINBYTES": (_PUSH, 0, 0), "BINBYTES": (_PUSH, 0, 0), "BINBYTES8": (_PUSH, 0, 0),
    "BYTEARRAY8": (_PUSH, 0, 0),
    "EMPTY_LIST": (_NEW, BuildCost.LIST, 0), "APPEND": (_APPEND, 0, 0), "APPENDS": (_APPENDS, 0, 0),
    "EMPTY_DICT": (_NEW, BuildCost.DICT, 0), "SETITEM": (_SETITEM, 0, 0), "SETITEMS": (_SETITEMS, 0, 0),
    "EMPTY_SET": (_NEW, BuildCost.SET, 0), "ADDITEMS": (_ADDITEMS, 0, 0), "FROZENSET": (_FROZENSET, 0, 0),
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
_STACK_GLOBAL_CODE = ord(pickle.STACK_GLOBAL)


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


class _Scan:
    """The unpickler's stack, marks and memo, one record per object, and what each rarer opcode does to
    them (the hot ones are handled in ``prescan``'s loop itself). Each handler takes the opcode, where it
    starts (``at``), where its argument ends (``pos``) and the table's argument width and tuple arity,
    and returns the position of the next opcode."""

    __slots__ = ("containers", "data", "fence", "marks", "memo", "stack")

    def __init__(self, data: bytes, limits: Limits) -> None:
        self.data = data
        self.containers = Containers(limits, len(data))
        self.stack: list[int] = []
        self.marks: list[int] = []
        self.fence = 0  # items below the innermost MARK are out of reach, as in the unpickler
        self.memo = array("q")  # pickle numbers memo entries 0, 1, 2...: an index past len(memo) is never legitimate

    def _index(self, at: int, pos: int, width: int) -> int:
        """A BINGET/BINPUT (1 byte) or LONG_BINGET/LONG_BINPUT (4 bytes) memo index."""
        return self.data[at + 1] if width == 1 else int.from_bytes(self.data[at + 1:pos], "little")

    def _pop_mark(self, code: int, at: int) -> tuple[int, list[int]]:
        """Close the innermost MARK: its position, and the items above it (taken off the stack)."""
        if not self.marks:
            raise _malformed(f"{_OPCODE_NAMES[code]} without a MARK", at)
        mark = self.marks.pop()
        self.fence = self.marks[-1] if self.marks else 0
        items = self.stack[mark:]
        del self.stack[mark:]
        return mark, items

    def _fill(self, mark: int, keys: list[int], items: list[int], at: int) -> None:
        """APPENDS, SETITEMS, ADDITEMS: ``items`` (``keys`` of them hashed) go into the container below them."""
        if mark <= self.fence:
            raise _malformed("items added to nothing", at)
        if any(keys):
            self.containers.hash(keys, at)
        self.containers.add(self.stack[-1], items, at)

    def op_noop(self, code: int, at: int, pos: int, width: int, arity: int) -> int:
        return pos

    def op_get(self, code: int, at: int, pos: int, width: int, arity: int) -> int:
        index = self._index(at, pos, width)
        if index >= len(self.memo):
            raise SnapshotLoadError(f"refused memo index {index} at byte {at}: only {len(self.memo)} objects were "
                                    "stored so far, and pickle numbers them in order")
        self.stack.append(self.memo[index])
        return pos

    def op_put(self, code: int, at: int, pos: int, width: int, arity: int) -> int:
        self._store(self._index(at, pos, width), at)
        return pos

    def op_memoize(self, code: int, at: int, pos: int, width: int, arity: int) -> int:
        self._store(len(self.memo), at)
        return pos

    def _store(self, index: int, at: int) -> None:
        memo, stack = self.memo, self.stack
        if len(stack) <= self.fence:
            raise _malformed("a memo store with nothing to store", at)
        if index < len(memo):
            memo[index] = stack[-1]
        elif index == len(memo):
            memo.append(stack[-1])
        else:
            raise SnapshotLoadError(f"refused memo index {index} at byte {at}: the next one in order is "
                                    f"{len(memo)} (an index sizes the unpickler's memo table)")

    def op_long1(self, code: int, at: int, pos: int, width: int, arity: int) -> int:
        self.stack.append(0 if self.data[at + 1] <= 8 else _AIMABLE)  # its length byte: 8 or fewer, an int below 2**63
        return pos

    def op_appends(self, code: int, at: int, pos: int, width: int, arity: int) -> int:
        mark, items = self._pop_mark(code, at)
        self._fill(mark, [], items, at)
        return pos

    def op_setitems(self, code: int, at: int, pos: int, width: int, arity: int) -> int:
        mark, items = self._pop_mark(code, at)
        if mark > self.fence and len(items) % 2:
            raise _malformed("an odd number of items for SETITEMS", at)
        self._fill(mark, items[::2], items, at)
        return pos

    def op_additems(self, code: int, at: int, pos: int, width: int, arity: int) -> int:
        mark, items = self._pop_mark(code, at)
        self._fill(mark, items, items, at)
        return pos

    def op_frozenset(self, code: int, at: int, pos: int, width: int, arity: int) -> int:
        _, items = self._pop_mark(code, at)
        if any(items):
            self.containers.hash(items, at)
        self.stack.append(self.containers.build(items, BuildCost.SET))
        return pos

    def op_tuple(self, code: int, at: int, pos: int, width: int, arity: int) -> int:
        _, items = self._pop_mark(code, at)
        self.stack.append(self.containers.build(items))
        return pos

    def op_pop_mark(self, code: int, at: int, pos: int, width: int, arity: int) -> int:
        self._pop_mark(code, at)
        return pos

    def op_setitem(self, code: int, at: int, pos: int, width: int, arity: int) -> int:
        stack = self.stack
        if len(stack) - self.fence < 3:
            raise _malformed("SETITEM without a dict, key and value", at)
        if stack[-2]:
            self.containers.hash(stack[-2:-1], at)
        self.containers.add(stack[-3], stack[-2:], at)
        del stack[-2:]
        return pos

    def op_append(self, code: int, at: int, pos: int, width: int, arity: int) -> int:
        stack = self.stack
        if len(stack) - self.fence < 2:
            raise _malformed("APPEND without a list and an item", at)
        self.containers.add(stack[-2], stack[-1:], at)
        stack.pop()
        return pos

    def op_tuple_n(self, code: int, at: int, pos: int, width: int, arity: int) -> int:
        stack = self.stack
        if len(stack) - self.fence < arity:
            raise _malformed("a tuple of more items than the stack holds", at)
        items = stack[len(stack) - arity:]
        del stack[len(stack) - arity:]
        stack.append(self.containers.build(items))
        return pos

    def op_pop(self, code: int, at: int, pos: int, width: int, arity: int) -> int:
        marks, stack = self.marks, self.stack
        if marks and marks[-1] == len(stack):  # the unpickler's POP drops an empty MARK
            marks.pop()
            self.fence = marks[-1] if marks else 0
        elif len(stack) <= self.fence:
            raise _malformed("POP of an empty stack", at)
        else:
            stack.pop()
        return pos

    def op_global(self, code: int, at: int, pos: int, width: int, arity: int) -> int:
        module, name, pos = _read_global(self.data, pos)
        if (PY2_MODULES.get(module, module), name) not in ALLOWED_GLOBALS:
            raise refused_global(module, name)
        self.stack.append(0)
        return pos

    def op_call(self, code: int, at: int, pos: int, width: int, arity: int) -> int:
        """STACK_GLOBAL and REDUCE: two operands in, one object out."""
        stack = self.stack
        if len(stack) - self.fence < 2:
            raise _malformed(f"{_OPCODE_NAMES[code]} without its two operands", at)
        operands = stack[-2:]
        del stack[-2:]
        # a constructor's result holds at most what its arguments held (set(list) and the like)
        stack.append(0 if code == _STACK_GLOBAL_CODE else self.containers.build(operands[1:], BuildCost.SET))
        return pos

    def result(self, at: int, built: int) -> int:
        """STOP: the size of what the pickle returns (``built``: bytes of its scalars and empty containers)."""
        if len(self.stack) <= self.fence:
            raise _malformed("STOP with nothing to return", at)
        self.check_built(at, built)
        top = self.stack[-1]
        return 1 if top >= 0 else self.containers.size[-2 - top]

    def check_built(self, at: int, built: int) -> None:
        """Refuse when the objects built (``built``: bytes of the scalars and empty containers pushed,
        plus what ``containers`` charged) would take more than the file's size allows."""
        built += self.containers.built
        budget = self.containers.built_budget
        if built > budget:
            raise SnapshotLoadError(
                f"refused at byte {at}: its objects would take more than the {budget // 2**20} MiB a "
                f"{len(self.data):,}-byte snapshot may build (a real one builds 6 to 11 times its size; this one "
                "is mostly empty containers or tiny objects, written to exhaust memory)")


_Handler = Callable[[_Scan, int, int, int, int, int], int]
# Effect -> its handler. _PUSH, _NEW and _STOP never get here: prescan's loop handles them itself.
_HANDLERS: list[_Handler] = [_Scan.op_noop] * 22
_HANDLERS[_GET], _HANDLERS[_PUT], _HANDLERS[_MEMOIZE] = _Scan.op_get, _Scan.op_put, _Scan.op_memoize
_HANDLERS[_LONG1], _HANDLERS[_POP], _HANDLERS[_POP_MARK] = _Scan.op_long1, _Scan.op_pop, _Scan.op_pop_mark
_HANDLERS[_APPEND], _HANDLERS[_APPENDS] = _Scan.op_append, _Scan.op_appends
_HANDLERS[_SETITEM], _HANDLERS[_SETITEMS], _HANDLERS[_ADDITEMS] = _Scan.op_setitem, _Scan.op_setitems, _Scan.op_additems
_HANDLERS[_TUPLE_N], _HANDLERS[_TUPLE], _HANDLERS[_FROZENSET] = _Scan.op_tuple_n, _Scan.op_tuple, _Scan.op_frozenset
_HANDLERS[_GLOBAL], _HANDLERS[_STACK_GLOBAL], _HANDLERS[_REDUCE] = _Scan.op_global, _Scan.op_call, _Scan.op_call


def _skip_counted(data: bytes, pos: int, end: int, at: int, prefix: int) -> int:
    """Past a length-prefixed argument (``prefix`` bytes of length, then that many), refusing a length
    longer than what is left before the unpickler preallocates it."""
    if pos + prefix > end:
        raise _truncated(at)
    length = data[pos] if prefix == 1 else int.from_bytes(data[pos:pos + prefix], "little")
    pos += prefix
    if length > end - pos:
        raise SnapshotLoadError(f"not a readable pickle: the {length}-byte argument at byte {at} is "
                                f"longer than the {end - pos} bytes left; truncated?")
    return pos + length


def prescan(data: bytes, limits: Limits) -> int:
    """Read every opcode without building anything, and refuse: opcodes outside _SNAPSHOT_OPCODES, globals
    outside ALLOWED_GLOBALS, memo indexes out of sequence, lengths past the end, and anything past the
    limits Containers keeps (objects, nesting, hashing). It mirrors the C unpickler's stack and marks,
    one record per object. One loop, hot opcodes first: a big snapshot has tens of millions. Returns the
    size of what the pickle builds (objects, as a walker counts them; tests compare it with one)."""
    table, handlers, end = _OPCODE_TABLE, _HANDLERS, len(data)
    scan = _Scan(data, limits)
    stack, marks, memo, containers = scan.stack, scan.marks, scan.memo, scan.containers
    push = stack.append
    new_size, new_height, new_flags = containers.size.append, containers.height.append, containers.flags.append
    pos = 0
    built = 0  # bytes of the scalars and empty containers pushed (the rest is charged by ``containers``)
    scalar = BuildCost.SCALAR
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
            scan.fence = len(stack)
            pos += 1
            continue
        if code == _MEMOIZE_CODE and len(stack) > scan.fence:
            memo.append(stack[-1])
            pos += 1
            continue
        entry = table[code]
        if entry is None:
            raise _opcode_refused(code, at)
        effect, width, prefix, record, arity = entry
        pos = _skip_counted(data, pos + 1, end, at, prefix) if prefix else pos + 1 + width
        if pos > end:
            raise _truncated(at)
        if effect == _PUSH:
            push(record)
            built += scalar
        elif effect == _NEW:  # an empty list, dict or set: containers.new(), inlined
            built += record  # its cost; past the budget, refused now rather than at STOP
            if built + containers.built > containers.built_budget:
                scan.check_built(at, built)
            new_size(1)
            new_height(1)
            new_flags(0)
            push(-1 - len(containers.size))
        elif effect == _STOP:
            return scan.result(at, built)
        else:
            pos = handlers[effect](scan, code, at, pos, width, arity)
