"""Exact training-memory terms of a real model, traced on the meta device (no memory, no GPU).

``trace_model(factory, input_shape)`` builds the model under ``torch.device("meta")``, runs one
forward and backward on a meta input, and counts:

- parameter, buffer and gradient bytes exactly (tied weights once: ``model.parameters()`` dedupes);
- optimizer-state bytes from the optimizer kind and the parameter shapes
  (``gpumemd.analysis.model_state.optimizer_state_bytes``: what ``torch.optim`` allocates);
- the bytes autograd saves for backward, counted by :class:`SavedTensorCounter` — the same counter
  the step profile component uses on a live job, so the traced figure and the live one are comparable.

and from them the peak with the same rule as the analytic estimate
(``params + optimizer state + max(gradients + intermediates, saved for backward)``).

Two ways to build without memory (``backend``): ``"meta"`` (the default: under ``torch.device("meta")``)
and ``"fake-cpu"`` (``FakeTensorMode`` with fake *CPU* tensors: every op takes the decisions the CPU
kernels take, so ``scaled_dot_product_attention`` picks the CPU flash kernel, where meta falls back to
the math path that saves the seq² attention matrix, and ``torch.autocast("cpu")`` applies: mixed
precision, ``bf16-mixed``/``fp16-mixed`` with fp32 weights and an autocast forward, always uses it).
Known limits: dedupe is by storage identity, which only a storage freed *during* the forward could
confuse; a model whose forward reads tensor values (``.item()``, data-dependent control flow) cannot
be traced; allocator rounding and kernel temporaries are not part of the terms.
"""

from __future__ import annotations

import contextlib
import importlib
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gpumemd.analysis.memory_estimate import peak_bytes
from gpumemd.analysis.model_state import ParamInfo, optimizer_intermediate_bytes, optimizer_state_bytes

if TYPE_CHECKING:
    import torch

DTYPES = ("float32", "float16", "bfloat16", "float64", "int64", "int32", "bool")
DTYPE_ALIASES = {"float": "float32", "half": "float16", "double": "float64", "long": "int64", "int": "int32"}
"""torch's own short names (``torch.long`` is ``torch.int64``), which a user types as often."""
TRACE_PRECISIONS = ("fp32", "bf16", "fp16", "bf16-mixed", "fp16-mixed")
TRACE_BACKENDS = ("meta", "fake-cpu")


class TraceError(ValueError):
    """The factory, the model or the input shape cannot be traced; the message says which and why."""


def storage_key(tensor: torch.Tensor) -> int | None:
    """Identity of the tensor's storage (the C++ StorageImpl address); views share it.

    Works for real and meta tensors alike (a meta storage has no data pointer but is still one
    object), so the trace and a real step deduplicate the same way. None when there is no storage
    (sparse, some wrapper subclasses).
    """
    try:
        return int(tensor.untyped_storage()._cdata)
    except (RuntimeError, NotImplementedError, AttributeError, TypeError):
        return None


def storage_nbytes(tensor: torch.Tensor) -> int:
    try:
        return int(tensor.untyped_storage().nbytes())
    except (RuntimeError, NotImplementedError, AttributeError, TypeError):
        try:
            return int(tensor.nbytes)
        except (RuntimeError, NotImplementedError, AttributeError):
            return 0


class SavedTensorCounter:
    """Counts the bytes autograd saves for backward while active (``with counter:``).

    Each saved tensor's storage is counted once (views of one activation, or a tensor saved by two
    ops, are one allocation); storages of ``exclude`` (parameters, buffers: counted elsewhere) are
    skipped. The pack hook returns ``tensor.detach()`` — the same storage and version counter, no
    copy — rather than the tensor object itself: returning the object makes a saved *output* hold
    its own ``grad_fn`` through Python, a reference cycle autograd cannot break if the graph is
    dropped without a backward. As with any saved-tensor hook, autograd skips its in-place
    modification check for the tensors saved while the counter is active.
    """

    def __init__(self, exclude: Iterable[torch.Tensor] = ()) -> None:
        self._exclude = {k for k in (storage_key(t) for t in exclude) if k is not None}
        self._seen: set[int] = set()
        self.bytes = 0
        self.saved = 0  # pack calls (a tensor saved twice counts twice here, once in bytes)
        self._ctx: Any = None

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        self.saved += 1
        key = storage_key(tensor)
        if key is None:
            self.bytes += storage_nbytes(tensor)
        elif key not in self._exclude and key not in self._seen:
            self._seen.add(key)
            self.bytes += storage_nbytes(tensor)
        return tensor.detach()

    @staticmethod
    def _unpack(tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def start(self) -> None:
        """Install the hooks (the step profile component calls this from a forward pre-hook)."""
        import torch

        if self._ctx is not None:
            return
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._ctx.__enter__()

    def stop(self) -> None:
        """Remove the hooks; what was counted stays in ``bytes``. Safe to call twice."""
        ctx, self._ctx = self._ctx, None
        if ctx is not None:
            ctx.__exit__(None, None, None)
        self._seen.clear()  # bounded: the set lives only for one forward

    def __enter__(self) -> SavedTensorCounter:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def scalar_loss(output: Any) -> torch.Tensor:
    """A scalar to backward from: the output itself if 0-d, else ``first_float_tensor.float().sum()``.

    ``sum`` and the dtype cast save no tensors, so the loss adds nothing to the saved bytes.
    Outputs may be a tensor, a tuple/list (first floating tensor) or a dict ("loss", else the first
    floating value).
    """
    import torch

    candidates: list[Any]
    if isinstance(output, torch.Tensor):
        candidates = [output]
    elif isinstance(output, dict):
        candidates = ([output["loss"]] if "loss" in output else []) + list(output.values())
    elif isinstance(output, (tuple, list)):
        candidates = list(output)
    else:
        candidates = [getattr(output, "loss", None), getattr(output, "logits", None)]
    for item in candidates:
        if isinstance(item, torch.Tensor) and item.is_floating_point() and item.requires_grad:
            return item if item.dim() == 0 else item.float().sum()
    raise TraceError(
        f"the model's output ({type(output).__name__}) holds no floating tensor that requires grad; "
        "return logits or a loss from forward()"
    )


def load_factory(spec: str) -> Callable[[], Any]:
    """``package.module:factory`` -> the callable; TraceError says what is wrong with the spec."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise TraceError(f"--model {spec!r} is not valid: expected package.module:factory")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # noqa: BLE001 - user code: any import-time error is "unimportable"
        raise TraceError(f"cannot import {module_name!r} for --model {spec!r}: {type(exc).__name__}: {exc}") from None
    target: Any = module
    for part in attr.split("."):
        try:
            target = getattr(target, part)
        except AttributeError:
            raise TraceError(f"module {module_name!r} has no attribute {attr!r} (from --model {spec!r})") from None
    if not callable(target):
        raise TraceError(f"--model {spec!r} names a {type(target).__name__}, not a callable factory")
    return target  # type: ignore[no-any-return,unused-ignore]


def parse_shape(text: str) -> tuple[int, ...]:
    """``"32,100"`` -> ``(32, 100)``; every dimension an integer >= 1."""
    parts = [p.strip() for p in text.replace("x", ",").split(",") if p.strip()]
    try:
        shape = tuple(int(p) for p in parts)
    except ValueError:
        raise TraceError(
            f"input shape {text!r} is not valid: expected integers separated by commas, e.g. 32,100"
        ) from None
    if not shape or any(d < 1 for d in shape):
        raise TraceError(f"input shape {text!r} is not valid: every dimension must be an integer >= 1")
    return shape


@dataclass(frozen=True, slots=True)
class TraceResult:
    """Exact terms of one training step of a real model (bytes)."""

    parameters: int  # unique parameter elements
    parameter_bytes: int
    buffer_bytes: int
    gradient_bytes: int
    optimizer_state_bytes: int
    optimizer_intermediates_bytes: int
    saved_for_backward_bytes: int
    saved_tensors: int
    tied_parameters: int  # parameters reachable under more than one name, counted once
    input_bytes: int
    optimizer: str
    precision: str

    @property
    def peak_bytes(self) -> int:
        return peak_bytes(
            self.parameter_bytes + self.buffer_bytes,
            self.optimizer_state_bytes,
            self.gradient_bytes,
            self.optimizer_intermediates_bytes,
            self.saved_for_backward_bytes,
        )


def count_model_state(model: Any, optimizer: str) -> tuple[int, int, int, int, int]:
    """(elements, parameter bytes, buffer bytes, optimizer state bytes, intermediates) of ``model``."""
    params = [p for p in model.parameters() if p.requires_grad]
    frozen = [p for p in model.parameters() if not p.requires_grad]
    infos = [ParamInfo(tuple(p.shape), p.element_size()) for p in params]
    elements = sum(i.numel for i in infos) + sum(p.numel() for p in frozen)
    param_bytes = sum(i.nbytes for i in infos) + sum(p.numel() * p.element_size() for p in frozen)
    buffer_bytes = sum(b.numel() * b.element_size() for b in model.buffers())
    return (elements, param_bytes, buffer_bytes, optimizer_state_bytes(infos, optimizer),
            optimizer_intermediate_bytes(infos, optimizer))


def trace_model(
    factory: Callable[[], Any],
    input_shape: tuple[int, ...],
    *,
    input_dtype: str = "float32",
    optimizer: str = "adamw",
    precision: str = "fp32",
    backend: str = "meta",
) -> TraceResult:
    """Build ``factory()`` without memory on ``backend`` and trace one forward/backward (see module doc)."""
    import torch

    if precision not in TRACE_PRECISIONS:
        raise TraceError(f"precision {precision!r} cannot be traced: expected one of {', '.join(TRACE_PRECISIONS)}")
    if backend not in TRACE_BACKENDS:
        raise TraceError(f"trace backend {backend!r} is not valid: expected one of {', '.join(TRACE_BACKENDS)}")
    input_dtype = DTYPE_ALIASES.get(input_dtype, input_dtype)
    if input_dtype not in DTYPES:
        raise TraceError(f"input dtype {input_dtype!r} is not valid: expected one of {', '.join(DTYPES)}")
    if not input_shape or any(not isinstance(d, int) or d < 1 for d in input_shape):
        raise TraceError(f"input shape {input_shape!r} is not valid: every dimension must be an integer >= 1")
    mixed = precision.endswith("-mixed")
    if mixed:
        backend = "fake-cpu"  # autocast needs a real device type; meta tensors are never autocast
    with contextlib.ExitStack() as stack:
        if backend == "fake-cpu":
            from torch._subclasses.fake_tensor import FakeTensorMode

            stack.enter_context(FakeTensorMode())
        return _trace(torch, factory, input_shape=input_shape, input_dtype=input_dtype, optimizer=optimizer,
                      precision=precision, backend=backend)
    raise AssertionError("unreachable")  # pragma: no cover - the with block always returns


def _trace(
    torch: Any,
    factory: Callable[[], Any],
    *,
    input_shape: tuple[int, ...],
    input_dtype: str,
    optimizer: str,
    precision: str,
    backend: str,
) -> TraceResult:
    where = "on the meta device" if backend == "meta" else "under FakeTensorMode"
    try:
        with torch.device("meta") if backend == "meta" else contextlib.nullcontext():
            model = factory()
    except Exception as exc:  # noqa: BLE001 - user code
        raise TraceError(f"the factory failed {where}: {type(exc).__name__}: {exc}") from None
    if not isinstance(model, torch.nn.Module):
        raise TraceError(f"the factory returned a {type(model).__name__}, not a torch.nn.Module")
    if backend == "meta" and any(not t.is_meta for t in [*model.parameters(), *model.buffers()]):
        model = model.to("meta")  # the factory pinned a device; its real tensors are released here
    if precision in ("bf16", "fp16"):
        model = model.to(torch.bfloat16 if precision == "bf16" else torch.float16)
    model.train()
    dtype = getattr(torch, input_dtype)
    if dtype.is_floating_point and precision in ("bf16", "fp16") and input_dtype == "float32":
        dtype = next((p.dtype for p in model.parameters()), dtype)
    x = torch.empty(input_shape, dtype=dtype, device="meta" if backend == "meta" else "cpu")
    tied = len(list(model.named_parameters(remove_duplicate=False))) - len(list(model.parameters()))
    elements, param_bytes, buffer_bytes, state_bytes, inter_bytes = count_model_state(model, optimizer)
    counter = SavedTensorCounter(exclude=[*model.parameters(), *model.buffers()])
    autocast = (
        torch.autocast("cpu", dtype=torch.bfloat16 if precision == "bf16-mixed" else torch.float16)
        if precision.endswith("-mixed") else contextlib.nullcontext()
    )
    try:
        with autocast, counter:
            loss = scalar_loss(model(x))
        loss.backward()
    except TraceError:
        raise
    except Exception as exc:  # noqa: BLE001 - user code
        raise TraceError(
            f"the model failed {where} on an input of shape {tuple(input_shape)} ({input_dtype}): "
            f"{type(exc).__name__}: {exc}{_integer_input_hint(exc, dtype)}"
        ) from None
    grad_bytes = sum(p.grad.numel() * p.grad.element_size() for p in model.parameters() if p.grad is not None)
    return TraceResult(
        parameters=elements,
        parameter_bytes=param_bytes,
        buffer_bytes=buffer_bytes,
        gradient_bytes=grad_bytes,
        optimizer_state_bytes=state_bytes,
        optimizer_intermediates_bytes=inter_bytes,
        saved_for_backward_bytes=counter.bytes,
        saved_tensors=counter.saved,
        tied_parameters=tied,
        input_bytes=math.prod(input_shape) * x.element_size(),
        optimizer=optimizer,
        precision=precision,
    )


def _integer_input_hint(exc: Exception, dtype: Any) -> str:
    """An embedding fed the default float input fails with torch's "... scalar types: Long, Int" message,
    which does not say which option fixes it."""
    if dtype.is_floating_point and "Long" in str(exc):
        return " (it takes integer inputs such as token ids: pass --input-dtype int64)"
    return ""
