"""One census's classification: every storage counted once, named tensors claimed first, a slice at a time.

``begin`` is the one pass over the heap (``gc.get_objects()``, filtered in C) and claims the named
tensors; the anonymous tensors it found are then held weakly and counted ``count(n)`` at a time, so a
census of a heap whose leak keeps 100k tensors can be spread over step ends without keeping any of
them alive across one (``probes.census.census_steps``). ``charge`` walks the autograd graphs of the tensors that
still have one. Between these calls the pass holds no tensor strongly: records hold theirs weakly.

A tensor that dies between ``begin`` and its ``count`` is not counted (it is no longer memory); one
made after ``begin`` is not seen (the census is of the heap ``begin`` saw). Identity checks stay sound
across slices: every tensor still counted was alive at ``begin``, alongside every tensor claimed there.
"""

from __future__ import annotations

import gc
import logging
import weakref
from collections.abc import Callable
from typing import Any

from gpumemd.probes.census.census_graph import GraphCharge, Root
from gpumemd.probes.census.census_groups import StorageRecord, TensorRef, describe
from gpumemd.probes.heap.autograd_graph import GraphWalk, tensors_in
from gpumemd.probes.heap.heap_tensors import select
from gpumemd.probes.heap.stepwise import hold_weakly
from gpumemd.probes.heap.storages import StorageKey, Storages
from gpumemd.records.census import CATEGORIES

log = logging.getLogger("gpumemd")

_PRIORITY = {category: rank for rank, category in enumerate(CATEGORIES)}  # lower wins a shared storage
_TENSOR, _PARAMETER, _MODULE, _OPTIMIZER = 0, 1, 2, 3

Named = tuple[Any, "str | None"]  # a tensor and its name, None when it has none
WeakRoot = tuple[StorageRecord, TensorRef]  # a counted storage and a tensor on it that had a grad_fn


class CensusPass:
    """The classification of one census; ``release()`` drops what it holds."""

    def __init__(self, graph_max_nodes: int) -> None:
        import torch  # lazily: `import gpumemd` stays light
        import torch.nn
        import torch.optim

        self.torch = torch
        self.graph_max_nodes = graph_max_nodes
        self.storages = Storages()
        self.counted: dict[StorageKey, StorageRecord] = {}
        self.records: list[StorageRecord] = []
        self.roots: list[WeakRoot] = []  # tensors whose graphs ``charge`` walks
        self._charge: GraphCharge | None = None  # the graph walk under way (over ``charge`` calls)
        self._next_root = 0  # the first root the next ``charge`` call walks
        self.claimed: set[int] = set()
        self.pending: list[TensorRef] = []  # scanned anonymous tensors not counted yet
        self.position = 0  # how many of ``pending`` were counted
        self.objects_scanned = 0
        self.graph_truncated = False
        self.errors = 0
        self.kinds = _kinds(torch)

    @property
    def left(self) -> int:
        """Scanned tensors not counted yet."""
        return len(self.pending) - self.position

    def begin(self, models: list[Any], optimizers: list[Any]) -> None:
        """Scan the heap, claim the named tensors and hold the rest weakly for ``count``."""
        tensors, parameters, modules, found_optimizers = self._scan()
        optimizers = optimizers + [o for o in found_optimizers if not any(o is p for p in optimizers)]
        keep: list[Any] = []  # the claimed tensors, alive while their ids are compared below
        self._claim_named(models, modules, optimizers, parameters, keep)
        claimed = self.claimed
        tensors = [t for t in tensors if id(t) not in claimed]
        try:
            self.pending = list(map(weakref.ref, tensors))
        except TypeError:  # a tensor type without weak references: count it now, hold the rest weakly
            self.pending = []
            for t in tensors:
                ref = hold_weakly(t)
                if isinstance(ref, weakref.ref):
                    self.pending.append(ref)
                else:
                    self._count([ref])
        tensors.clear()
        keep.clear()

    def count(self, n: int) -> None:
        """Count the next ``n`` scanned tensors (``left`` says how many remain)."""
        start = self.position
        self.position = min(len(self.pending), start + n)
        self._count(self.pending[start:self.position])
        if self.position == len(self.pending):
            self.pending = []
            self.position = 0

    def charge(self, slice_nodes: int | None = None, stop: Callable[[], bool] | None = None) -> bool:
        """Walk the autograd graphs of the counted tensors that still have one (``census_graph``),
        at most ``slice_nodes`` nodes in this call (None: up to the census's bound), and no further
        root once ``stop()`` says so (the slice's time is up: a root's walk is never cut by it);
        whether roots are left for another call. A root whose walk a slice's node bound cuts is a
        lower bound (``graph_truncated``)."""
        charge = self._charge
        if charge is None:
            charge = self._charge = GraphCharge([record for record, _ in self.roots], self.counted, self.storages,
                                                self._error)
        bound = self.graph_max_nodes - charge.reached
        if slice_nodes is not None:
            bound = min(bound, slice_nodes)
        roots = self._live_roots(self._next_root)
        first = roots[0][0] if roots else None
        cut = charge.walk(roots, GraphWalk(max(0, bound)), stop) if roots and bound > 0 else None
        roots.clear()
        if cut is not None:
            if cut == first:
                self.graph_truncated = True  # one graph larger than a slice: walked that far
                cut += 1
            # else the cut graph is walked again, whole, by the next slice (what it charged stays charged once)
            if charge.reached < self.graph_max_nodes and cut < len(self.roots):
                self._next_root = cut
                return True
            self.graph_truncated = True
        charge.settle()
        self._charge = None
        self.roots.clear()
        return False

    def _live_roots(self, start: int) -> list[Root]:
        roots: list[Root] = []
        for i in range(start, len(self.roots)):
            record, ref = self.roots[i]
            t = ref()
            if t is None:
                continue
            try:
                grad_fn = t.grad_fn
            except Exception as exc:  # noqa: BLE001
                self._error(f"a {type(t).__name__}", exc)
                continue
            if grad_fn is not None:
                roots.append((i, record, grad_fn))
        return roots

    def _scan(self) -> tuple[list[Any], list[Any], list[Any], list[Any]]:
        kinds = self.kinds
        objects = gc.get_objects()
        self.objects_scanned = len(objects)
        found = select(objects, kinds)
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
        self, models: list[Any], modules: list[Any], optimizers: list[Any], loose_parameters: list[Any],
        keep: list[Any],
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
            self._claim(p, "parameter", name, keep)
        for p, name in params.values():
            self._claim_grad(p, f"{name}.grad" if name else None, "a parameter's .grad", keep)
        param_names = {key: name or "" for key, (_, name) in params.items()}
        for opt in optimizers:
            self._claim_optimizer_state(opt, param_names, keep)
        for b, name in buffers:
            self._claim(b, "buffer", name, keep)
    def _model_tensors(self, named_models: list[tuple[str, Any]]) -> tuple[dict[int, Named], list[Named]]:
        """(id -> (parameter, FQN), each parameter once; [(buffer, FQN)]) of the models."""
        params: dict[int, Named] = {}
        buffers: list[Named] = []
        for prefix, model in named_models:
            try:
                for fqn, p in model.named_parameters():
                    params.setdefault(id(p), (p, prefix + _uncompiled(fqn)))
                buffers.extend((b, prefix + _uncompiled(fqn)) for fqn, b in model.named_buffers() if b is not None)
            except Exception as exc:  # noqa: BLE001 - a model we cannot walk is named from the scan instead
                self._error("a model's named_parameters()/named_buffers()", exc)
        return params, buffers

    def _claim_grad(self, tensor: Any, name: str | None, what: str, keep: list[Any] | None) -> None:
        """``tensor.grad`` (not gc-visible on its own) as a gradient."""
        try:
            grad = tensor.grad
        except Exception as exc:  # noqa: BLE001 - an exotic subclass: no gradient for it then
            self._error(what, exc)
            return
        if grad is not None:
            self._claim(grad, "gradient", name, keep)

    def _claim_optimizer_state(self, opt: Any, param_names: dict[int, str], keep: list[Any]) -> None:
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
                    self._claim(tensor, "optimizer_state", f"{cls}[{label}].{key}", keep)

    def _claim(self, tensor: Any, category: str, name: str | None, keep: list[Any] | None,
               ref: TensorRef | None = None) -> None:
        """Count ``tensor`` (any kind) under ``category``; a shared storage keeps its best claim.
        ``keep`` (while named tensors are claimed) keeps it alive until the scan's ids are compared."""
        self.claimed.add(id(tensor))
        if keep is not None:
            keep.append(tensor)
        try:
            parts = self.storages.parts(tensor)
            grad_fn = tensor.grad_fn
        except Exception as exc:  # noqa: BLE001 - one unreadable tensor must not end the census
            self._error(f"a {type(tensor).__name__}", exc)
            return
        if not parts:
            return  # meta, fake or empty: no memory
        if ref is None:
            ref = hold_weakly(tensor)
        if grad_fn is not None and category == "other":
            category = "graph"
        counted = self.counted
        new = [(key, nbytes) for key, nbytes in dict(parts).items() if key not in counted]
        if new:
            record = StorageRecord(sum(nbytes for _, nbytes in new), category, name, ref, *describe(tensor))
            self.records.append(record)
            for key, _ in new:
                counted[key] = record
        else:
            record = counted[parts[0][0]]
            if _PRIORITY[category] < _PRIORITY[record.category]:
                record.category, record.name = category, name
                record.represent(tensor, ref)
        if grad_fn is not None:
            self.roots.append((record, ref))

    # --- every other tensor -----------------------------------------------------------------------

    def _count(self, refs: list[TensorRef]) -> None:
        """The hot loop: scanned tensors not claimed by name, still alive. Plain strided tensors inline."""
        counted, records, roots, claimed = self.counted, self.records, self.roots, self.claimed
        plain = self.storages.plain
        leaves: list[Any] = []
        for ref in refs:
            t = ref()
            if t is None or id(t) in claimed:
                continue  # died since the scan (no longer memory), or claimed by a name since
            if type(t) not in plain:
                self._claim(t, "other", None, None, ref)  # subclasses: wrappers, fakes, lazy parameters
                continue
            try:
                st = t.untyped_storage()
            except Exception:  # noqa: BLE001 - sparse layouts have no storage: count their components
                self._claim(t, "other", None, None, ref)
                continue
            try:
                ptr = st.data_ptr()
                if ptr == 0:
                    continue  # empty, or meta (a size but no memory)
                dev = t.device
                key = (dev, ptr)
                grad_fn = t.grad_fn
                if grad_fn is None and t.requires_grad:
                    leaves.append(t)  # a raw leaf optimised by hand: its .grad is not gc-visible
                record = counted.get(key)
                if record is None:
                    try:
                        shape: Any = t.shape
                    except Exception:  # noqa: BLE001 - nested tensors have no sizes()
                        shape = ()
                    record = StorageRecord(st.nbytes(), "other" if grad_fn is None else "graph", None, ref,
                                           dev, t.dtype, shape)
                    counted[key] = record
                    records.append(record)
                else:
                    _seen_again(record, t, ref, grad_fn)
                if grad_fn is not None:
                    roots.append((record, ref))
            except Exception as exc:  # noqa: BLE001 - a tensor torch cannot describe is skipped
                self._error(f"a {type(t).__name__}", exc)
        for leaf in leaves:
            self._claim_grad(leaf, None, "a leaf's .grad", None)
        leaves.clear()

    def release(self) -> None:
        self._charge = None
        self.counted.clear()
        self.records.clear()
        self.roots.clear()
        self.claimed.clear()
        self.pending = []
        self.position = 0

    def _error(self, what: str, exc: BaseException) -> None:
        self.errors += 1
        if self.errors == 1:  # one line per census at most; the count is in Census.errors
            log.debug("gpumemd: census skipped %s (%s: %s)", what, type(exc).__name__, exc)


def _seen_again(record: StorageRecord, t: Any, ref: TensorRef, grad_fn: Any) -> None:
    """Another anonymous tensor on a counted storage: a live ``grad_fn`` makes an anonymous storage
    graph memory, and a base describes the storage better than one of its views."""
    if record.category != "other":
        return
    if grad_fn is not None:
        record.category = "graph"
        record.represent(t, ref)
        return
    current = record.ref()
    if current is None or (current._base is not None and t._base is None):
        record.represent(t, ref)


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


_COMPILED = "_orig_mod"
"""The child under which ``torch.compile``'s wrapper (``OptimizedModule``) holds the model: its
parameters are named as the model names them ("0.weight", not "_orig_mod.0.weight")."""


def _uncompiled(fqn: str) -> str:
    return fqn.replace(_COMPILED + ".", "")


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
    return [(f"{type(getattr(m, _COMPILED, m)).__name__}.", m) for m in roots]


def _optimizer_params(opt: Any) -> list[Any]:
    try:
        return [p for group in opt.param_groups for p in group["params"]]
    except Exception:  # noqa: BLE001 - not a torch.optim-shaped optimizer
        return []
