"""The storages behind a tensor: the one storage identity of the census and the graph walks.

A storage is ``(device, storage data_ptr)``, so views fold into their base and the bytes are the
storage's bytes. Meta and fake tensors (data pointer 0, no memory) have none; sparse tensors have
their component storages; wrapper subclasses (DTensor, jagged nested) have their inner tensors'
storages, so a DTensor's local shard is one storage, under whichever name claims it first.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, TypeAlias

from gpumemd.probes.heap.heap_tensors import subclasses

if TYPE_CHECKING:
    import torch

StorageKey: TypeAlias = "tuple[torch.device, int]"
Part: TypeAlias = "tuple[StorageKey, int]"  # a storage and its bytes

_MAX_WRAPPER_DEPTH = 4


class Storages:
    """Reads the storages behind tensors; caches per device and per tensor type (bounded by the
    devices and tensor subclasses a job has)."""

    def __init__(self) -> None:
        import torch  # lazily: `import gpumemd` stays light

        self.tensor_type = torch.Tensor
        self.plain: set[type] = {torch.Tensor, torch.nn.Parameter}
        self.no_memory_types = _no_memory_types()
        self.wrapper_types: dict[type, bool] = {}
        self.devices: dict[torch.device, tuple[str, bool]] = {}  # device -> (name, is meta)
        self.strided = torch.strided
        self.layouts_coo = torch.sparse_coo
        self.layouts_compressed_rows = {torch.sparse_csr, torch.sparse_bsr}
        self.layouts_compressed_cols = {torch.sparse_csc, torch.sparse_bsc}

    def device(self, dev: torch.device) -> tuple[str, bool]:
        """(name, whether it is the meta device); callers read ``devices`` first, this fills it."""
        info = (str(dev), dev.type == "meta")
        self.devices[dev] = info
        return info

    def parts(self, t: torch.Tensor, depth: int = 0) -> list[Part]:
        """The storages behind ``t`` with their bytes; [] for no memory."""
        tp = type(t)
        if tp not in self.plain:
            if tp in self.no_memory_types:
                return []  # FakeTensor, lazy modules' uninitialized parameters: no memory yet
            if self._is_wrapper(tp):
                return self._inner_parts(t, depth)
        layout = t.layout
        if layout is self.strided:
            dev = t.device
            if (self.devices.get(dev) or self.device(dev))[1]:
                return []
            st = t.untyped_storage()
            ptr = st.data_ptr()
            return [((dev, ptr), st.nbytes())] if ptr != 0 else []
        return self._sparse_parts(t, layout, depth)

    @staticmethod
    def own(t: torch.Tensor) -> list[Part]:
        """The storage of ``t`` itself, no components: what a strided tensor's ``untyped_storage()``
        holds; raises for layouts without one (sparse). For the saved bytes of one tensor's graph."""
        st = t.untyped_storage()
        ptr = st.data_ptr()
        return [((t.device, ptr), st.nbytes())] if ptr else []

    def _is_wrapper(self, tp: type) -> bool:
        is_wrapper = self.wrapper_types.get(tp)
        if is_wrapper is None:
            is_wrapper = hasattr(tp, "__tensor_flatten__") and hasattr(tp, "__tensor_unflatten__")
            self.wrapper_types[tp] = is_wrapper
        return is_wrapper

    def _inner_parts(self, t: torch.Tensor, depth: int) -> list[Part]:
        if depth >= _MAX_WRAPPER_DEPTH:
            return []
        inner_names, _ = t.__tensor_flatten__()  # type: ignore[attr-defined]  # a wrapper subclass's protocol
        inners = (getattr(t, name, None) for name in inner_names)
        return [p for inner in inners if isinstance(inner, self.tensor_type) for p in self.parts(inner, depth + 1)]

    def _sparse_parts(self, t: torch.Tensor, layout: torch.layout, depth: int) -> list[Part]:
        if depth >= _MAX_WRAPPER_DEPTH:
            return []
        components: tuple[torch.Tensor, ...]
        if layout is self.layouts_coo:
            components = (t._indices(), t._values())
        elif layout in self.layouts_compressed_rows:
            components = (t.crow_indices(), t.col_indices(), t.values())
        elif layout in self.layouts_compressed_cols:
            components = (t.ccol_indices(), t.row_indices(), t.values())
        else:
            return []  # an unknown layout: nothing we can attribute bytes to
        return [p for component in components for p in self.parts(component, depth + 1)]


def _no_memory_types() -> frozenset[type]:
    """Tensor types that have a size but no memory: FakeTensor (if torch has loaded it; never imported
    just for this: its data_ptr() warns) and lazy modules' UninitializedParameter/Buffer (any torch
    call on them raises), with their subclasses."""
    module = sys.modules.get("torch._subclasses.fake_tensor")
    parameter = sys.modules.get("torch.nn.parameter")
    bases = [getattr(module, "FakeTensor", None), getattr(parameter, "UninitializedTensorMixin", None)]
    return subclasses(*[b for b in bases if isinstance(b, type)])
