"""What the unpickler would build, counted while ``snapshot_prescan`` reads the opcodes: each container's
size (objects in it, as a walker counts them), nesting and flags, the bytes the objects built take, and
what hashing dict keys and set members walks. Past ``Limits`` (the file's size sets the budgets), it
refuses with the reason.

A container is a record ``-2 - i`` on prescan's stack: number ``i`` here.
"""

from __future__ import annotations

from array import array

from gpumemd.probes.snapshots.snapshot_rules import BuildCost, Limits, SnapshotLoadError

# Container flags: hashable (a tuple or frozenset, or what a constructor returned: it may be one, and
# hashing it walks it); placed (already inside another container).
_HASHABLE, _PLACED = 1, 2


class Containers:
    """The containers the unpickler would build, by number: each one's size (objects in it, counting a
    shared one each time a walker reaches it), height and flags. Sizes are final when a container is
    placed in another, because a pickler never adds to one after that (only a cycle needs it, and we
    refuse those): so the sizes sum up exactly, in time linear in the file, however much is shared."""

    def __init__(self, limits: Limits, nbytes: int) -> None:
        self.size = array("q")
        self.height = bytearray()
        self.flags = bytearray()
        self.budget = limits.tree_budget(nbytes)
        self.max_depth = limits.max_depth
        self.max_hashed = limits.max_hashed_nodes
        self.hashed = 0
        self.built = 0  # bytes the objects built take (estimated: BuildCost), but for scalars and empty ones
        self.built_budget = limits.built_budget(nbytes)

    def new(self, kind: int = 0, size: int = 1, height: int = 1) -> int:
        """A new container's record."""
        if size > self.budget:
            raise self._too_many()
        if height > self.max_depth:
            raise self._too_deep()
        self.size.append(size)
        self.height.append(height)
        self.flags.append(kind)
        return -1 - len(self.size)

    def _too_many(self) -> SnapshotLoadError:
        return SnapshotLoadError(f"refused a snapshot of more than {self.budget} objects as a walker counts them "
                                 "(each shared one every time it is reached): shared references that multiply, "
                                 "which PyTorch never writes")

    def _too_deep(self) -> SnapshotLoadError:
        return SnapshotLoadError(f"refused containers nested more than {self.max_depth} deep: a real snapshot "
                                 "nests about 7")

    def place(self, items: list[int]) -> tuple[int, int]:
        """Size and height of ``items`` together, which go into a container now."""
        self.built += BuildCost.ITEM * len(items)
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
                raise self._too_deep()
            self.height[i] = height + 1

    def build(self, items: list[int], cost: int = BuildCost.TUPLE) -> int:
        """TUPLE*, FROZENSET, REDUCE: a new (hashable) container made of ``items``."""
        self.built += cost
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
