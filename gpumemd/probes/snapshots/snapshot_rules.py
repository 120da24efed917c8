"""What a snapshot file someone sent may hold and how big it may get: the rules both loading passes apply.

A snapshot someone sent is untrusted input: the restricted unpickler stops it running code, and the
bounds below stop it exhausting memory, time or the C stack. Two passes, each linear in the file:
``snapshot_prescan`` reads every opcode and builds nothing (it tracks what the unpickler would build:
memo indexes, each container's size and nesting, what gets hashed), then ``snapshot_unpickle`` builds
the objects, calling only wrappers that charge what they copy. Both refuse by the rules here.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Limits:
    """The bounds; tests pass small ones (a 2 GiB file is no unit-test input)."""

    # The biggest real snapshots (a long job's history with Python and C++ stacks) are hundreds of MB;
    # 2 GiB leaves headroom, and the loaded objects take several times the file in RAM anyway. Every
    # opcode is at least one byte, so this caps the opcode count too; the limits that grow with the file
    # are per byte.
    max_bytes: int = 2 * 2**30
    # A memo reference (BINGET) costs 2 bytes however big its object: PyTorch shares each frame dict
    # between all tracebacks and one traceback list between a block's alloc and free events, and a
    # crafted file puts a list into a list 1000 times per level. Counting each object every time a walker
    # (json.dumps, ==, a summary) reaches it, a real snapshot is a few objects per byte of pickle; 64
    # admits it with room to spare, while a structure that multiplies per level passes any such bound
    # within a few dozen levels.
    tree_nodes_per_byte: int = 64
    min_tree_nodes: int = 2**20  # small files: a million objects still walk in well under a second
    # A real snapshot nests about 7 deep (snapshot > segments > segment > blocks > block > frames >
    # frame); recursive walkers give up near 1000, and only a crafted file nests deeper.
    max_depth: int = 100
    # set(), frozenset() and bytearray() copy their argument, which a memo reference passes again for 2
    # bytes: a pickle writes each element once, so 4 copied elements per byte of file is ample.
    copy_elements_per_byte: int = 4
    min_copy_elements: int = 2**20
    # Hashing (dict keys, set members) is where a few bytes get leverage: a tuple's hash is not cached
    # and walks all of it (tuples of shared tuples double per level; a deep one overflows the C stack,
    # and CPython 3.11 segfaults), and floats, ints past 2**63 and tuples hash predictably enough to
    # collide on purpose (quadratic inserts). str and bytes hashes are randomised and an int below 2**63
    # shares its hash with at most a few others: those are free. Snapshots key everything with str, so
    # the rest (tuples, frozensets, floats, complex, big ints) get this many objects in all.
    max_hashed_nodes: int = 4096
    # Memory: what the objects built take, estimated per opcode (``BUILD_COST``), against the file's
    # size. A real snapshot builds 6-11 bytes per byte of pickle (measured: shared frames 6x, unshared
    # 11x); one byte of EMPTY_SET builds a 216-byte set, so a 10 MB file of empty sets took 2.6 GB. 32
    # per byte admits every real snapshot three times over and holds a crafted one to the same multiple
    # of its size.
    built_bytes_per_byte: int = 32
    min_built_bytes: int = 64 * 2**20

    def built_budget(self, nbytes: int) -> int:
        return max(self.min_built_bytes, self.built_bytes_per_byte * nbytes)

    def tree_budget(self, nbytes: int) -> int:
        return max(self.min_tree_nodes, self.tree_nodes_per_byte * nbytes)

    def copy_budget(self, nbytes: int) -> int:
        return max(self.min_copy_elements, self.copy_elements_per_byte * nbytes)


DEFAULT_LIMITS = Limits()


class BuildCost:
    """CPython's sizes (64-bit, 3.10-3.13), slightly rounded up: what the estimate charges per object."""

    SCALAR = 32  # an int or float; a str or bytes also takes its length, which is in the file
    LIST, DICT, SET, TUPLE = 56, 64, 216, 48  # empty (a set's table starts at 8 slots)
    ITEM = 24  # per item placed in a container: a list slot with growth room, half a dict entry, a set slot

# A real snapshot holds only dict/list/tuple/int/float/str/bool/None, which pickle encodes without any
# global. These harmless constructors are admitted for snapshots other tools re-saved; protocol 2 writes
# bytes and bytearray through _codecs.encode(text, "latin1") and bytes().
ALLOWED_GLOBALS: frozenset[tuple[str, str]] = frozenset({
    ("builtins", "set"), ("builtins", "frozenset"), ("builtins", "bytearray"), ("builtins", "bytes"),
    ("builtins", "complex"), ("collections", "OrderedDict"), ("_codecs", "encode"),
})
# Protocols 0-2 write Python 2's module name (fix_imports); the C unpickler maps it back only in the
# find_class we override.
PY2_MODULES = {"__builtin__": "builtins"}


class SnapshotLoadError(ValueError):
    """A snapshot that is truncated, not a pickle, not a snapshot, too big, or that tries to load code."""


def refused_global(module: str, name: str) -> SnapshotLoadError:
    return SnapshotLoadError(
        f"refused to load {module}.{name}: a snapshot may hold only builtin containers and scalars "
        "(this file was not written by PyTorch, or was tampered with)"
    )

