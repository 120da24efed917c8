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
3. Storage identity is ``(device, storage data_ptr)`` (``probes.storages``): views fold into their
   base, bytes are the storage's bytes. Meta and fake tensors (data pointer 0, no memory) are
   excluded; sparse tensors count their component storages; wrapper subclasses (DTensor, jagged
   nested) count their inner tensors, so a DTensor's local shard is counted once, under the
   DTensor's name.
4. Graph retention (``probes.census_graph``): from each live ``grad_fn`` the autograd-graph walk
   reads the saved tensors; saved storages not counted anywhere else are charged to the tensor that
   keeps the graph alive. The walk is bounded in nodes (the bytes are then a lower bound).
5. Grouping (``probes.census_groups``), then holders (``probes.holders.fill_holders``) for the few
   anonymous groups that grew, once the pass has dropped every tensor it held.

The census never synchronises a device, allocates on it or calls ``.item()``: it reads metadata
(storage pointers and sizes, dtypes, shapes) only. One caveat: reading a ``_saved_*`` attribute runs
the unpack hook of ``saved_tensors_hooks`` that were active when the graph was built (offloading hooks
copy back to the device); pass ``graph=False`` for jobs that offload activations that way.
"""

from __future__ import annotations

import gc
import itertools
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

from gpumemd.probes.autograd_graph import tensors_in
from gpumemd.probes.census_graph import Root, charge_graphs
from gpumemd.probes.census_groups import Grouping, StorageRecord
from gpumemd.probes.holders import fill_holders
from gpumemd.probes.storages import StorageKey, Storages
from gpumemd.records.census import CATEGORIES, Census
from gpumemd.records.samples import AllocatorSample

if TYPE_CHECKING:
    import torch

log = logging.getLogger("gpumemd")

LARGEST = 50
"""How many of the largest storages a census keeps as ``TensorEntry`` (``Census.largest``)."""

GRAPH_MAX_NODES = 50_000
"""Autograd nodes walked per census at most; beyond it graph bytes are a lower bound."""

HOLDERS_TIME_BUDGET_S = 1.0
"""Time for all holder lookups of one census together (each one scans the heap)."""

_PRIORITY = {category: rank for rank, category in enumerate(CATEGORIES)}  # lower wins a shared storage
_TENSOR, _PARAMETER, _MODULE, _OPTIMIZER = 0, 1, 2, 3

Named = tuple["torch.Tensor", "str | None"]  # a tensor and its name, None when it has none


def take_census(
    *,
    models: Iterable[Any] = (),
    optimizers: Iterable[Any] = (),
    step: int | None = None,
    holders: int = 3,
    pause_s: float | None = None,
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
    ``pause_s`` (a census in a step end): the lookups stop when the whole census has run that long, so
    a big heap's census is one bounded pause (the leak finding that needs a holder looks it up itself).
    """
    start = clock()
    models = _distinct(models)
    optimizers = _distinct(optimizers)
    census = _Pass(graph_max_nodes)
    census.run(models, optimizers, graph=graph)
    grouping = Grouping(census.records, census.storages)
    groups, samples, owners = grouping.groups()
    entries = grouping.largest(largest)
    invisible = grouping.invisible(allocator or ())
    objects, truncated, errors = census.objects_scanned, census.graph_truncated, census.errors
    census.release()  # drop every reference the pass holds before the heap is searched for holders
    del census, grouping
    budget_s = HOLDERS_TIME_BUDGET_S if pause_s is None else min(HOLDERS_TIME_BUDGET_S, pause_s - (clock() - start))
    if holders > 0 and budget_s > 0:
        groups = fill_holders(groups, samples, owners, holders=holders, previous=previous, budget_s=budget_s)
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
    """The classification of one census: every storage counted once, named tensors claimed first;
    ``release()`` drops every tensor it references."""

    def __init__(self, graph_max_nodes: int) -> None:
        import torch  # lazily: `import gpumemd` stays light
        import torch.nn
        import torch.optim

        self.torch = torch
        self.graph_max_nodes = graph_max_nodes
        self.storages = Storages()
        self.counted: dict[StorageKey, StorageRecord] = {}
        self.records: list[StorageRecord] = []
        self.roots: list[Root] = []  # (record, live grad_fn) pairs to walk
        self.claimed: set[int] = set()
        self.keep: list[Any] = []  # keeps claimed tensors alive so their ids stay unique
        self.objects_scanned = 0
        self.graph_truncated = False
        self.errors = 0
        self.kinds = _kinds(torch)

    def run(self, models: list[Any], optimizers: list[Any], *, graph: bool) -> None:
        tensors, parameters, modules, found_optimizers = self._scan()
        optimizers = optimizers + [o for o in found_optimizers if not any(o is p for p in optimizers)]
        self._claim_named(models, modules, optimizers, parameters)
        self._count_scanned(tensors)
        tensors.clear()
        if graph and self.roots:
            self.graph_truncated = charge_graphs(
                self.roots, self.counted, self.storages, self.graph_max_nodes, self._error
            )

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

    # --- named tensors, claimed first -------------------------------------------------------------

    def _claim_named(
        self, models: list[Any], modules: list[Any], optimizers: list[Any], loose_parameters: list[Any]
    ) -> None:
        """Parameters, gradients, optimizer state and buffers, claimed (and named) before the scan."""
        named_models: list[tuple[str, Any]] = [("", m) for m in models]
        named_models.extend(_root_modules(modules, models))
        params, buffers = self._model_tensors(named_models)
        # Parameters only the optimizers know about (raw tensors, models not found) and loose Parameters.
        unnamed = [p for opt in optimizers for p in _optimizer_params(opt)] + loose_parameters
        for p in unnamed:
            params.setdefault(id(p), (p, None))
        for p, name in params.values():
            self._claim(p, "parameter", name)
        for p, name in params.values():
            self._claim_grad(p, f"{name}.grad" if name else None, "a parameter's .grad")
        param_names = {key: name or "" for key, (_, name) in params.items()}
        for opt in optimizers:
            self._claim_optimizer_state(opt, param_names)
        for b, name in buffers:
            self._claim(b, "buffer", name)

    def _model_tensors(self, named_models: list[tuple[str, Any]]) -> tuple[dict[int, Named], list[Named]]:
        """(id -> (parameter, FQN), each parameter once; [(buffer, FQN)]) of the models."""
        params: dict[int, Named] = {}
        buffers: list[Named] = []
        for prefix, model in named_models:
            try:
                for fqn, p in model.named_parameters():
                    params.setdefault(id(p), (p, prefix + fqn))
                buffers.extend((b, prefix + fqn) for fqn, b in model.named_buffers() if b is not None)
            except Exception as exc:  # noqa: BLE001 - a model we cannot walk is named from the scan instead
                self._error("a model's named_parameters()/named_buffers()", exc)
        return params, buffers

    def _claim_grad(self, tensor: Any, name: str | None, what: str) -> None:
        """``tensor.grad`` (not gc-visible on its own) as a gradient."""
        try:
            grad = tensor.grad
        except Exception as exc:  # noqa: BLE001 - an exotic subclass: no gradient for it then
            self._error(what, exc)
            return
        if grad is not None:
            self._claim(grad, "gradient", name)

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
                for tensor in tensors_in(value, self.torch.Tensor):
                    self._claim(tensor, "optimizer_state", f"{cls}[{label}].{key}")

    def _claim(self, tensor: Any, category: str, name: str | None) -> None:
        """Count ``tensor`` (any kind) under ``category``; a shared storage keeps its best claim."""
        self.claimed.add(id(tensor))
        self.keep.append(tensor)
        try:
            parts = self.storages.parts(tensor)
            grad_fn = tensor.grad_fn
        except Exception as exc:  # noqa: BLE001 - one unreadable tensor must not end the census
            self._error(f"a {type(tensor).__name__}", exc)
            return
        if not parts:
            return  # meta, fake or empty: no memory
        if grad_fn is not None and category == "other":
            category = "graph"
        counted = self.counted
        new = [(key, nbytes) for key, nbytes in dict(parts).items() if key not in counted]
        if new:
            record = StorageRecord(sum(nbytes for _, nbytes in new), category, name, tensor)
            self.records.append(record)
            for key, _ in new:
                counted[key] = record
        else:
            record = counted[parts[0][0]]
            if _PRIORITY[category] < _PRIORITY[record.category]:
                record.category, record.name, record.tensor = category, name, tensor
        if grad_fn is not None:
            self.roots.append((record, grad_fn))

    # --- every other tensor -----------------------------------------------------------------------

    def _count_scanned(self, tensors: list[Any]) -> None:
        """The hot loop: every scanned tensor not claimed by name. Plain strided tensors inline."""
        counted, records, roots, claimed = self.counted, self.records, self.roots, self.claimed
        plain = self.storages.plain
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
                record = counted.get(key)
                if record is None:
                    record = StorageRecord(st.nbytes(), "other" if grad_fn is None else "graph", None, t)
                    counted[key] = record
                    records.append(record)
                else:
                    _seen_again(record, t, grad_fn)
                if grad_fn is not None:
                    roots.append((record, grad_fn))
            except Exception as exc:  # noqa: BLE001 - a tensor torch cannot describe is skipped
                self._error(f"a {type(t).__name__}", exc)
        for leaf in leaves:
            self._claim_grad(leaf, None, "a leaf's .grad")
        leaves.clear()

    def release(self) -> None:
        self.counted.clear()
        self.records.clear()
        self.roots.clear()
        self.keep.clear()
        self.claimed.clear()

    def _error(self, what: str, exc: BaseException) -> None:
        self.errors += 1
        if self.errors == 1:  # one line per census at most; the count is in Census.errors
            log.debug("gpumemd: census skipped %s (%s: %s)", what, type(exc).__name__, exc)


def _seen_again(record: StorageRecord, t: Any, grad_fn: Any) -> None:
    """Another anonymous tensor on a counted storage: a live ``grad_fn`` makes an anonymous storage
    graph memory, and a base describes the storage better than one of its views."""
    if grad_fn is not None and record.category == "other":
        record.category, record.tensor = "graph", t
    elif record.category == "other" and record.tensor._base is not None and t._base is None:
        record.tensor = t


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
