"""The tensor census: one pass over the gc-visible heap, every storage counted once, classified, named.

What the pass does, in order (TORCH_MEMORY_API.md §7 has the facts it relies on):

1. ``gc.get_objects()`` filtered by ``type(o) in kinds``, where ``kinds`` holds every live subclass of
   ``TensorBase``, ``nn.Module`` and ``Optimizer`` (walked from ``__subclasses__`` at each census).
   A set lookup on the exact type is ~3x cheaper than ``isinstance(o, torch.Tensor)`` (whose
   metaclass makes every miss walk the MRO), which is what keeps the census near the bare floor.
   Weak proxies report their own type, so they are never touched.
2. Named tensors are claimed first: parameters (FQNs from registered models, else from the root
   modules found in the scan), gradients through the parameters (``.grad`` is not gc-visible on its
   own), optimizer state through the optimizers (``Adam[<fqn>].exp_avg``, ``step`` counters included),
   buffers. Then every scanned tensor not yet claimed becomes ``graph`` (it has a live ``grad_fn``)
   or ``other``.
3. Storage identity is ``(device, storage data_ptr)``: views fold into their base, bytes are the
   storage's bytes. Meta and fake tensors (data pointer 0, no memory) are excluded; sparse tensors
   count their component storages; wrapper subclasses (DTensor, jagged nested) count their inner
   tensors, so a DTensor's local shard is counted once, under the DTensor's name.
4. Graph retention: from each live ``grad_fn`` the walk follows ``next_functions`` and reads the
   ``_saved_*`` attributes; saved storages not counted anywhere else are charged to the tensor that
   keeps the graph alive. The walk is bounded in nodes (the bytes are then a lower bound).

The census never synchronises a device, allocates on it or calls ``.item()``: it reads metadata
(storage pointers and sizes, dtypes, shapes) only. One caveat: reading a ``_saved_*`` attribute runs
the unpack hook of ``saved_tensors_hooks`` that were active when the graph was built (offloading hooks
copy back to the device); pass ``graph=False`` for jobs that offload activations that way.
"""

from __future__ import annotations

import gc
import heapq
import itertools
import logging
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from gpumemd.records.census import CATEGORIES, Census, CensusGroup, GroupKey, TensorEntry
from gpumemd.records.device import cuda_device
from gpumemd.records.samples import AllocatorSample

log = logging.getLogger("gpumemd")

LARGEST = 50
"""How many of the largest storages a census keeps as ``TensorEntry`` (``Census.largest``)."""

GRAPH_MAX_NODES = 50_000
"""Autograd nodes walked per census at most; beyond it graph bytes are a lower bound."""

HOLDERS_TIME_BUDGET_S = 1.0
"""Time for all holder lookups of one census together (each one scans the heap)."""

_PRIORITY = {category: rank for rank, category in enumerate(CATEGORIES)}  # lower wins a shared storage
_TENSOR, _PARAMETER, _MODULE, _OPTIMIZER = 0, 1, 2, 3
_MAX_WRAPPER_DEPTH = 4

# Per autograd-node class: the attributes that hold saved tensors. Bounded by the number of node
# classes torch (and the job's custom Functions) define.
_SAVED_ATTRS: dict[type, tuple[str, ...]] = {}
_SAVED_ATTRS_MAX = 4096


class _Storage:
    """One storage (or the component storages of one sparse/wrapper tensor) during a census."""

    __slots__ = ("category", "gkey", "graph_bytes", "kept_by", "name", "nbytes", "tensor")

    def __init__(self, nbytes: int, category: str, name: str | None, tensor: Any) -> None:
        self.nbytes = nbytes
        self.category = category
        self.name = name
        self.tensor = tensor  # the representative: its shape/dtype/device describe the storage
        self.graph_bytes = 0
        self.gkey: tuple[Any, ...] | None = None  # (device, dtype, shape, category, name), set late
        self.kept_by: _Storage | None = None  # the graph-keeping tensor whose autograd graph saves this


def take_census(
    *,
    models: Iterable[Any] = (),
    optimizers: Iterable[Any] = (),
    step: int | None = None,
    holders: int = 3,
    graph: bool = True,
    previous: Census | None = None,
    allocator: Sequence[AllocatorSample] | None = None,
    largest: int = LARGEST,
    graph_max_nodes: int = GRAPH_MAX_NODES,
    clock: Callable[[], float] = time.perf_counter,
    wall_clock: Callable[[], float] = time.time,
) -> Census:
    """Count every live tensor storage once, classify and name it; see the module docstring.

    ``models``/``optimizers`` name parameters, gradients and optimizer state; ``step`` is the
    step the census is of; ``allocator`` (the last allocator reading) gives the invisible bytes and
    ``previous`` (the last census) the groups that grew, for holders. ``holders`` is how many
    groups get a ``who_holds`` line: the anonymous groups that grew most since ``previous``, or the
    largest anonymous groups when there is no ``previous``; all lookups together stop after ``HOLDERS_TIME_BUDGET_S``.
    """
    start = clock()
    models = _distinct(models)
    optimizers = _distinct(optimizers)
    census = _Pass(graph_max_nodes)
    census.run(models, optimizers, graph=graph)
    groups, samples, owners = census.groups()
    entries = census.largest(largest)
    invisible = census.invisible(allocator or ())
    objects, truncated, errors = census.objects_scanned, census.graph_truncated, census.errors
    census.release()  # drop every reference the pass holds before the heap is searched for holders
    del census
    if holders > 0:
        groups = _fill_holders(groups, samples, owners, holders, previous)
    samples.clear()
    owners.clear()
    return Census(
        step=step,
        taken_at=wall_clock(),
        duration_s=clock() - start,
        groups=tuple(groups),
        largest=tuple(entries),
        objects_scanned=objects,
        invisible_bytes_by_device=invisible,
        graph_truncated=truncated,
        errors=errors,
    )


def _distinct(objects: Iterable[Any]) -> list[Any]:
    """Each object once, by identity: a model may define ``__eq__`` (a tensor-valued one cannot be a bool)."""
    out: list[Any] = []
    for obj in objects:
        if not any(obj is seen for seen in out):
            out.append(obj)
    return out


class _Pass:
    """The state of one census pass; ``release()`` drops every tensor it references."""

    def __init__(self, graph_max_nodes: int) -> None:
        import torch
        import torch.nn
        import torch.optim

        self.torch = torch
        self.graph_max_nodes = graph_max_nodes
        self.storages: dict[tuple[Any, int], _Storage] = {}
        self.records: list[_Storage] = []
        self.roots: list[tuple[_Storage, Any]] = []  # (record, live grad_fn) pairs to walk
        self.claimed: set[int] = set()
        self.keep: list[Any] = []  # keeps claimed tensors alive so their ids stay unique
        self.devices: dict[Any, tuple[str, bool]] = {}
        self.dtypes: dict[Any, str] = {}
        self.wrapper_types: dict[type, bool] = {}
        self.objects_scanned = 0
        self.graph_truncated = False
        self.errors = 0
        self.kinds = _kinds(torch)
        self.plain = {torch.Tensor, torch.nn.Parameter}
        self.no_memory_types = _no_memory_types(torch)
        self.strided = torch.strided
        self.layouts_coo = torch.sparse_coo
        self.layouts_compressed_rows = {torch.sparse_csr, torch.sparse_bsr}
        self.layouts_compressed_cols = {torch.sparse_csc, torch.sparse_bsc}

    # --- the pass ------------------------------------------------------------------------------

    def run(self, models: list[Any], optimizers: list[Any], *, graph: bool) -> None:
        tensors, parameters, modules, found_optimizers = self._scan()
        optimizers = optimizers + [o for o in found_optimizers if not any(o is p for p in optimizers)]
        self._claim_named(models, modules, optimizers, parameters)
        self._count_scanned(tensors)
        tensors.clear()
        if graph and self.roots:
            self._walk_graphs()

    def _scan(self) -> tuple[list[Any], list[Any], list[Any], list[Any]]:
        kinds = self.kinds
        objects = gc.get_objects()
        self.objects_scanned = len(objects)
        try:
            # The same as [o for o in objects if type(o) in kinds], iterated in C: about twice as fast.
            found = list(itertools.compress(objects, map(kinds.__contains__, map(type, objects))))
        except TypeError:  # a metaclass that makes types unhashable: check one object at a time
            found = [o for o in objects if _kind_of(o, kinds) is not None]
        del objects
        tensors: list[Any] = []
        parameters: list[Any] = []
        modules: list[Any] = []
        optimizers: list[Any] = []
        by_kind = (tensors, parameters, modules, optimizers)
        for obj in found:
            by_kind[kinds[type(obj)]].append(obj)
        found.clear()
        return tensors + parameters, parameters, modules, optimizers

    def _claim_named(
        self, models: list[Any], modules: list[Any], optimizers: list[Any], loose_parameters: list[Any]
    ) -> None:
        """Parameters, gradients, optimizer state and buffers, claimed (and named) before the scan."""
        named_models: list[tuple[str, Any]] = [("", m) for m in models]
        named_models.extend(_root_modules(modules, models))
        param_names: dict[int, str] = {}
        params: list[tuple[Any, str | None]] = []
        buffers: list[tuple[Any, str]] = []
        for prefix, model in named_models:
            try:
                for fqn, p in model.named_parameters():
                    if id(p) not in param_names:
                        param_names[id(p)] = prefix + fqn
                        params.append((p, prefix + fqn))
                for fqn, b in model.named_buffers():
                    if b is not None:
                        buffers.append((b, prefix + fqn))
            except Exception as exc:  # noqa: BLE001 - a model we cannot walk is named from the scan instead
                self._error("a model's named_parameters()/named_buffers()", exc)
        # Parameters only the optimizers know about (raw tensors, models not found) and loose Parameters.
        for opt in optimizers:
            for p in _optimizer_params(opt):
                if id(p) not in param_names:
                    param_names[id(p)] = ""
                    params.append((p, None))
        for p in loose_parameters:
            if id(p) not in param_names:
                param_names[id(p)] = ""
                params.append((p, None))
        for p, name in params:
            self._claim(p, "parameter", name)
        for p, name in params:
            try:
                grad = p.grad
            except Exception as exc:  # noqa: BLE001 - an exotic subclass: no gradient for it then
                self._error("a parameter's .grad", exc)
                continue
            if grad is not None:
                self._claim(grad, "gradient", f"{name}.grad" if name else None)
        for opt in optimizers:
            self._claim_optimizer_state(opt, param_names)
        for b, name in buffers:
            self._claim(b, "buffer", name)

    def _claim_optimizer_state(self, opt: Any, param_names: dict[int, str]) -> None:
        cls = type(opt).__name__
        try:
            index = {id(p): i for i, p in enumerate(_optimizer_params(opt))}
            items = list(opt.state.items())
        except Exception as exc:  # noqa: BLE001 - not a torch.optim-shaped optimizer
            self._error(f"{cls}.state", exc)
            return
        for param, state in items:
            if not isinstance(state, dict):
                continue
            label = param_names.get(id(param)) or f"#{index.get(id(param), '?')}"
            for key, value in list(state.items()):
                for tensor in _tensors_in(value, self.torch.Tensor):
                    self._claim(tensor, "optimizer_state", f"{cls}[{label}].{key}")

    def _claim(self, tensor: Any, category: str, name: str | None) -> None:
        """Count ``tensor`` (any kind) under ``category``; a shared storage keeps its best claim."""
        self.claimed.add(id(tensor))
        self.keep.append(tensor)
        try:
            parts = self._components(tensor, 0)
            grad_fn = tensor.grad_fn
        except Exception as exc:  # noqa: BLE001 - one unreadable tensor must not end the census
            self._error(f"a {type(tensor).__name__}", exc)
            return
        if not parts:
            return  # meta, fake or empty: no memory
        if grad_fn is not None and category == "other":
            category = "graph"
        storages = self.storages
        new = [(key, nbytes) for key, nbytes in dict(parts).items() if key not in storages]
        if new:
            record = _Storage(sum(nbytes for _, nbytes in new), category, name, tensor)
            self.records.append(record)
            for key, _ in new:
                storages[key] = record
        else:
            record = storages[parts[0][0]]
            if _PRIORITY[category] < _PRIORITY[record.category]:
                record.category, record.name, record.tensor = category, name, tensor
        if grad_fn is not None:
            self.roots.append((record, grad_fn))

    def _count_scanned(self, tensors: list[Any]) -> None:
        """The hot loop: every scanned tensor not claimed by name. Plain strided tensors inline."""
        storages, records, roots, claimed, plain = self.storages, self.records, self.roots, self.claimed, self.plain
        leaves: list[Any] = []
        for t in tensors:
            if id(t) in claimed:
                continue
            if type(t) not in plain:
                self._claim(t, "other", None)  # subclasses: wrappers, fakes, lazy parameters
                continue
            try:
                st = t.untyped_storage()
            except Exception:  # noqa: BLE001 - sparse layouts have no storage: count their components
                self._claim(t, "other", None)
                continue
            try:
                ptr = st.data_ptr()
                if ptr == 0:
                    continue  # empty, or meta (a size but no memory)
                key = (t.device, ptr)
                grad_fn = t.grad_fn
                if grad_fn is None and t.requires_grad:
                    leaves.append(t)  # a raw leaf optimised by hand: its .grad is not gc-visible
                record = storages.get(key)
                if record is None:
                    record = _Storage(st.nbytes(), "other" if grad_fn is None else "graph", None, t)
                    storages[key] = record
                    records.append(record)
                elif grad_fn is not None and record.category == "other":
                    record.category, record.tensor = "graph", t
                elif record.category == "other" and record.tensor._base is not None and t._base is None:
                    record.tensor = t  # describe the storage by its base, not by one of its views
                if grad_fn is not None:
                    roots.append((record, grad_fn))
            except Exception as exc:  # noqa: BLE001 - a tensor torch cannot describe is skipped
                self._error(f"a {type(t).__name__}", exc)
        for leaf in leaves:
            try:
                grad = leaf.grad
            except Exception as exc:  # noqa: BLE001
                self._error("a leaf's .grad", exc)
                continue
            if grad is not None:
                self._claim(grad, "gradient", None)
        leaves.clear()

    def _components(self, t: Any, depth: int) -> list[tuple[tuple[Any, int], int]]:
        """The storages behind ``t`` as ((device, data_ptr), nbytes); [] for no memory."""
        tp = type(t)
        if tp not in self.plain:
            if tp in self.no_memory_types:
                return []  # FakeTensor, lazy modules' uninitialized parameters: no memory yet
            is_wrapper = self.wrapper_types.get(tp)
            if is_wrapper is None:
                is_wrapper = hasattr(tp, "__tensor_flatten__") and hasattr(tp, "__tensor_unflatten__")
                self.wrapper_types[tp] = is_wrapper
            if is_wrapper:
                if depth >= _MAX_WRAPPER_DEPTH:
                    return []
                inner_names, _ = t.__tensor_flatten__()
                out: list[tuple[tuple[Any, int], int]] = []
                for inner_name in inner_names:
                    inner = getattr(t, inner_name, None)
                    if isinstance(inner, self.torch.Tensor):
                        out.extend(self._components(inner, depth + 1))
                return out
        layout = t.layout
        if layout is self.strided:
            dev = t.device
            info = self.devices.get(dev) or self._device(dev)
            if info[1]:
                return []
            st = t.untyped_storage()
            ptr = st.data_ptr()
            return [((dev, ptr), st.nbytes())] if ptr != 0 else []
        if depth >= _MAX_WRAPPER_DEPTH:
            return []
        parts: tuple[Any, ...]
        if layout is self.layouts_coo:
            parts = (t._indices(), t._values())
        elif layout in self.layouts_compressed_rows:
            parts = (t.crow_indices(), t.col_indices(), t.values())
        elif layout in self.layouts_compressed_cols:
            parts = (t.ccol_indices(), t.row_indices(), t.values())
        else:
            return []  # an unknown layout: nothing we can attribute bytes to
        out = []
        for part in parts:
            out.extend(self._components(part, depth + 1))
        return out

    def _dtype(self, dt: Any) -> str:
        name = self.dtypes[dt] = str(dt).removeprefix("torch.")
        return name

    def _device(self, dev: Any) -> tuple[str, bool]:
        info = (str(dev), dev.type == "meta")
        self.devices[dev] = info
        return info

    # --- graph retention -----------------------------------------------------------------------

    def _walk_graphs(self) -> None:
        """Charge each saved storage that nothing else counts to the tensor whose graph keeps it.

        Many roots are intermediates of one another (in ``total = total + loss`` every saved
        activation that still has a Python wrapper is itself a root): a root whose ``grad_fn`` is
        reached from another root's graph is absorbed by it (union-find), so the bytes and the
        ``kept_by`` of visible saved tensors end up on the outermost tensor, the one a holder
        lookup can name.
        """
        roots, storages, tensor_type = self.roots, self.storages, self.torch.Tensor
        parent = list(range(len(roots)))

        def find(i: int) -> int:
            while parent[i] != i:
                parent[i] = parent[parent[i]]
                i = parent[i]
            return i

        root_of_node: dict[int, int] = {}
        for i, (_, grad_fn) in enumerate(roots):
            root_of_node.setdefault(id(grad_fn), i)
        visited: dict[int, tuple[Any, int]] = {}  # node id -> (node, walking root): keeps ids unique
        charged: set[tuple[Any, int]] = set()
        charged_bytes = [0] * len(roots)
        kept: dict[int, tuple[_Storage, int]] = {}  # visible saved storage -> the root whose graph saved it
        budget = self.graph_max_nodes
        try:
            for i, (record, root) in enumerate(roots):
                seen = visited.get(id(root))
                if seen is not None:
                    if find(seen[1]) != find(i):
                        parent[find(i)] = find(seen[1])  # an intermediate of an earlier root's graph
                    continue
                stack = [root]
                visited[id(root)] = (root, i)
                while stack:
                    node = stack.pop()
                    for attr in _saved_attrs(type(node)):
                        try:
                            value = getattr(node, attr)
                        except Exception:  # noqa: BLE001 - freed by backward(), or undefined: nothing kept
                            continue
                        for saved in _tensors_in(value, tensor_type):
                            try:
                                parts = self._components(saved, 0)
                            except Exception as exc:  # noqa: BLE001
                                self._error("a saved tensor", exc)
                                continue
                            for key, nbytes in parts:
                                visible = storages.get(key)
                                if visible is None:
                                    if key not in charged:
                                        charged.add(key)
                                        charged_bytes[i] += nbytes
                                elif visible is not record and id(visible) not in kept:
                                    kept[id(visible)] = (visible, i)
                    try:
                        following = node.next_functions
                    except Exception:  # noqa: BLE001 - a node type without edges
                        continue
                    for edge in following:
                        nxt = edge[0]
                        if nxt is None:
                            continue
                        seen = visited.get(id(nxt))
                        if seen is None:
                            if len(visited) >= budget:
                                self.graph_truncated = True
                                return
                            visited[id(nxt)] = (nxt, i)
                            stack.append(nxt)
                        elif seen[1] != i:
                            other = root_of_node.get(id(nxt))
                            if other is not None and find(other) != find(i):
                                parent[find(other)] = find(i)  # that root lives inside this graph
        finally:
            visited.clear()
            for i, (record, _) in enumerate(roots):
                owner = roots[find(i)][0]
                owner.graph_bytes += charged_bytes[i]
                if owner is not record and record.kept_by is None:
                    record.kept_by = owner
            for record, i in kept.values():
                owner = roots[find(i)][0]
                if owner is not record and record.kept_by is None:
                    record.kept_by = owner
                if record.category == "other":
                    # An anonymous tensor an autograd graph saves (its Python wrapper outlived the call
                    # by PyObject preservation) is graph memory, not "other": `total += loss` must show
                    # up as graph growth whether or not the saved inputs happen to be gc-visible.
                    record.category = "graph"

    # --- results -------------------------------------------------------------------------------

    def groups(self) -> tuple[list[CensusGroup], dict[GroupKey, Any], dict[GroupKey, Any]]:
        """Groups, largest first; per group a sample tensor and, when an autograd graph saves
        that sample, the tensor keeping the graph alive (both for holder lookups)."""
        # Plain tuples as keys while aggregating: the dataclass __hash__/__eq__ run in Python.
        acc: dict[tuple[Any, ...], list[Any]] = {}
        devices, dtypes = self.devices, self.dtypes
        for record in self.records:
            t = record.tensor
            try:  # _group_key inlined: this runs once per storage
                dev, dt = t.device, t.dtype
                key = (
                    (devices.get(dev) or self._device(dev))[0],
                    dtypes.get(dt) or self._dtype(dt),
                    t.shape,  # a torch.Size hashes and compares like the tuple it becomes below
                    record.category,
                    record.name,
                )
            except Exception:  # noqa: BLE001 - nested tensors have no sizes()
                key = self._group_key(record)
            record.gkey = key
            size = record.nbytes + record.graph_bytes
            counts = acc.get(key)
            if counts is None:
                acc[key] = [1, record.nbytes, record.graph_bytes, record, size]
            else:
                counts[0] += 1
                counts[1] += record.nbytes
                counts[2] += record.graph_bytes
                if size > counts[4]:
                    counts[3], counts[4] = record, size
        groups = []
        samples: dict[GroupKey, Any] = {}
        owners: dict[GroupKey, Any] = {}
        for key, c in acc.items():
            group_key = GroupKey(key[0], key[1], tuple(key[2]), key[3], key[4])
            groups.append(CensusGroup(group_key, c[0], c[1], c[2]))
            samples[group_key] = c[3].tensor
            if c[3].kept_by is not None:
                owners[group_key] = c[3].kept_by.tensor
        acc.clear()
        groups.sort(key=lambda g: g.nbytes + g.graph_bytes, reverse=True)
        return groups, samples, owners

    def _group_key(self, record: _Storage) -> tuple[Any, ...]:
        if record.gkey is not None:
            return record.gkey
        t = record.tensor
        device, dtype, shape = "?", "?", ()
        try:
            dev = t.device
            device = (self.devices.get(dev) or self._device(dev))[0]
            dt = t.dtype
            dtype = self.dtypes.get(dt) or self._dtype(dt)
            shape = tuple(t.shape)
        except Exception:  # noqa: BLE001 - nested tensors have no sizes(); keep what was read
            pass
        return (device, dtype, shape, record.category, record.name)

    def largest(self, n: int) -> list[TensorEntry]:
        top = heapq.nlargest(n, self.records, key=lambda r: r.nbytes + r.graph_bytes)
        out = []
        for record in top:
            device, dtype, shape, category, name = self._group_key(record)
            out.append(
                TensorEntry(
                    nbytes=record.nbytes,
                    shape=tuple(shape),
                    dtype=dtype,
                    device=device,
                    category=category,
                    name=name,
                    graph_bytes=record.graph_bytes,
                )
            )
        return out

    def invisible(self, allocator: Sequence[AllocatorSample]) -> dict[str, int]:
        """CUDA allocated bytes minus the gc-visible storages on that device (graph estimates excluded:
        what autograd saved is part of what the census cannot see)."""
        if not allocator:
            return {}
        visible: dict[str, int] = {}
        for record in self.records:
            try:
                dev = record.tensor.device
            except Exception:  # noqa: BLE001
                continue
            name = (self.devices.get(dev) or self._device(dev))[0]
            visible[name] = visible.get(name, 0) + record.nbytes
        out = {}
        for sample in allocator:
            if sample.allocated_bytes is None:
                continue
            name = cuda_device(sample.device)
            out[name] = max(0, sample.allocated_bytes - visible.get(name, 0))
        return out

    def release(self) -> None:
        self.storages.clear()
        self.records.clear()
        self.roots.clear()
        self.keep.clear()
        self.claimed.clear()

    def _error(self, what: str, exc: BaseException) -> None:
        self.errors += 1
        if self.errors == 1:  # one line per census at most; the count is in Census.errors
            log.debug("gpumemd: census skipped %s (%s: %s)", what, type(exc).__name__, exc)


# --- helpers ---------------------------------------------------------------------------------------


def _kinds(torch: Any) -> dict[type, int]:
    """Every live subclass of TensorBase / Parameter / Module / Optimizer -> its kind."""
    kinds: dict[type, int] = {}
    for base, kind in (
        (torch._C.TensorBase, _TENSOR),
        (torch.nn.Module, _MODULE),
        (torch.optim.Optimizer, _OPTIMIZER),
        (torch.nn.Parameter, _PARAMETER),  # last: Parameter subclasses override the tensor kind
    ):
        kinds[base] = kind
        stack = [base]
        while stack:
            cls = stack.pop()
            for sub in type.__subclasses__(cls):
                if kinds.get(sub) != kind:
                    kinds[sub] = kind
                    stack.append(sub)
    return kinds


def _no_memory_types(torch: Any) -> set[type]:
    """Tensor types that have a size but no memory: FakeTensor (if torch has loaded it; never imported
    just for this: its data_ptr() warns) and lazy modules' UninitializedParameter/Buffer (any torch
    call on them raises), with their subclasses."""
    module = sys.modules.get("torch._subclasses.fake_tensor")
    bases = [getattr(module, "FakeTensor", None), getattr(torch.nn.parameter, "UninitializedTensorMixin", None)]
    out: set[type] = {b for b in bases if isinstance(b, type)}
    stack: list[type] = list(out)
    while stack:
        sub: type
        for sub in type.__subclasses__(stack.pop()):
            if sub not in out:
                out.add(sub)
                stack.append(sub)
    return out


def _kind_of(obj: Any, kinds: dict[type, int]) -> int | None:
    try:
        return kinds.get(type(obj))
    except TypeError:
        return None


def _root_modules(modules: list[Any], registered: list[Any]) -> list[tuple[str, Any]]:
    """Modules found in the scan that no other module contains, and that own tensors; each with
    the prefix that keeps FQNs of several roots apart (none when there is only one)."""
    children: set[int] = set()
    for m in modules:
        try:
            children.update(id(c) for c in m._modules.values() if c is not None)
        except Exception:  # noqa: BLE001 - a Module subclass that broke __init__
            continue
    known = {id(m) for m in registered}
    roots = []
    for m in modules:
        if id(m) in children or id(m) in known:
            continue
        try:
            if next(iter(m.parameters()), None) is None and next(iter(m.buffers()), None) is None:
                continue
        except Exception:  # noqa: BLE001
            continue
        roots.append(m)
    if len(roots) == 1 and not registered:
        return [("", roots[0])]
    return [(f"{type(m).__name__}.", m) for m in roots]


def _optimizer_params(opt: Any) -> list[Any]:
    try:
        return [p for group in opt.param_groups for p in group["params"]]
    except Exception:  # noqa: BLE001 - not a torch.optim-shaped optimizer
        return []


def _tensors_in(value: Any, tensor_type: type) -> list[Any]:
    if isinstance(value, tensor_type):
        return [value]
    if isinstance(value, (list, tuple)):
        return [v for v in value if isinstance(v, tensor_type)]
    return []


def _saved_attrs(node_type: type) -> tuple[str, ...]:
    attrs = _SAVED_ATTRS.get(node_type)
    if attrs is None:
        names = dir(node_type)
        attrs = tuple(a for a in names if a.startswith("_saved_"))
        if "saved_tensors" in names:  # custom autograd.Function nodes (ctx.save_for_backward)
            attrs += ("saved_tensors",)
        if len(_SAVED_ATTRS) < _SAVED_ATTRS_MAX:
            _SAVED_ATTRS[node_type] = attrs
    return attrs


def _fill_holders(
    groups: list[CensusGroup],
    samples: dict[GroupKey, Any],
    owners: dict[GroupKey, Any],
    holders: int,
    previous: Census | None,
) -> list[CensusGroup]:
    """Look up who holds a sample of the few groups that need it (each lookup scans the heap).

    A tensor that only an autograd graph keeps (a saved activation) has no gc referrer: it is
    described as ``autograd graph of <who holds the tensor that keeps the graph>``."""
    from gpumemd.probes.holders import who_holds

    anonymous = [g for g in groups if g.key.name is None]
    if previous is not None:
        before = {g.key: g for g in previous.groups}

        def growth(g: CensusGroup) -> int:
            old = before.get(g.key)
            return g.nbytes + g.graph_bytes - (old.nbytes + old.graph_bytes if old else 0)

        grown = [(growth(g), g) for g in anonymous if g.count > getattr(before.get(g.key), "count", 0)
                 or growth(g) > 0]
        grown.sort(key=lambda pair: pair[0], reverse=True)
        chosen = [g for _, g in grown[:holders]]
    else:
        chosen = anonymous[:holders]
    if not chosen:
        return groups
    deadline = time.monotonic() + HOLDERS_TIME_BUDGET_S
    found: dict[GroupKey, str] = {}
    owner_lines: dict[int, str | None] = {}
    for group in chosen:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        sample = samples.get(group.key)
        if sample is None:
            continue
        holder = who_holds(sample, time_budget_s=remaining, ignore=(samples, owners))
        del sample
        owner = owners.get(group.key)
        if holder is None and owner is not None:
            if id(owner) not in owner_lines:
                remaining = max(0.0, deadline - time.monotonic())
                owner_lines[id(owner)] = who_holds(owner, time_budget_s=remaining, ignore=(samples, owners))
            line = owner_lines[id(owner)]
            holder = f"autograd graph of {line}" if line else "an autograd graph"
        del owner
        if holder is not None:
            found[group.key] = holder
    if not found:
        return groups
    return [
        CensusGroup(g.key, g.count, g.nbytes, g.graph_bytes, found[g.key]) if g.key in found else g
        for g in groups
    ]
