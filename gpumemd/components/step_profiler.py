"""The step profile: memory at the points of a sampled training step (forward start, forward peak, after
backward, after the optimizer step) and the bytes autograd saved for backward.

Opt-in (``attach(step_profile=True)``), one step in ``step_profile_every_steps``. Where a step is cut:

- **forward start / end**: a forward pre-hook and an ``always_call`` forward hook on the *root*
  model only — the registered models (``attach(model=...)``), or else the first module with
  parameters the job runs (found by a global forward pre-hook that removes itself as soon as it
  has found it). Per-submodule global hooks would cost on every step; these cost one Python call
  and a modulo on non-sampled steps.
- **after backward**: a global optimizer step pre-hook (armed only inside a sampled step).
- **after step**: the agent's step end (``on_step``).

What is measured, and where:

- On CUDA: the allocator's allocated bytes at each boundary, and the allocator's peak during the
  forward and during ``optimizer.step()``. To read those two peaks the component **resets torch's
  peak counters** (``reset_peak_memory_stats``) at forward start and before the optimizer step of
  sampled steps only; ``max_memory_allocated()`` read by the job itself then covers only the time
  since that reset.
- Everywhere (CPU included): bytes saved for backward, counted by
  :class:`gpumemd.probes.planning.trace.SavedTensorCounter` during the root forward (the tensors are handed
  back as same-storage aliases, nothing is copied or changed in what autograd keeps), and the
  exact parameter, gradient and optimizer-state bytes of the root model and the job's optimizers.
- On CPU no allocator statistic exists, so the device figures are left ``None`` rather than guessed.

Gradient accumulation: only the first forward of a sampled step is measured.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gpumemd.components.base import ComponentBase
from gpumemd.records.device import CPU, Device
from gpumemd.records.step_profile import StepProfile

if TYPE_CHECKING:
    from gpumemd.components.base import AgentView
    from gpumemd.probes.planning.trace import SavedTensorCounter
    from gpumemd.records.step import StepRecord

log = logging.getLogger("gpumemd")

_IDLE, _FORWARD, _BACKWARD, _STEP = "idle", "forward", "backward", "step"


@dataclass(frozen=True)
class StepProfileOptions:
    """What the step profile component reads of the configuration (``Config.options(StepProfileOptions)``)."""

    step_profile_every_steps: int


class StepProfileComponent(ComponentBase):
    """Publishes ``step_profile=StepProfile`` after each sampled step."""

    name = "step_profile"

    def __init__(self, options: StepProfileOptions) -> None:
        every_steps = options.step_profile_every_steps
        if every_steps < 1:
            raise ValueError(f"StepProfileComponent(every_steps={every_steps!r}) needs a step count of at least 1")
        self._every = every_steps
        self._agent: AgentView | None = None
        self._roots: list[Any] = []  # the models whose forward is measured
        self._handles: list[Any] = []  # the hooks, there only from the eve of a profiled step to its end
        self._discovery: Any = None
        self._counter: SavedTensorCounter | None = None
        self._failed = False
        self._reset()

    def _reset(self) -> None:
        if self._counter is not None:
            self._counter.stop()  # safe twice: a finished step's counter stopped at its forward's end
        self._state = _IDLE
        self._counter = None
        self._root: Any = None
        self._cuda_index: int | None = None
        self._device = CPU
        self._values: dict[str, Any] = {}
        self._overhead = 0.0

    # --- lifecycle ---------------------------------------------------------------------------

    def start(self, agent: AgentView) -> None:
        self._agent = agent
        self._roots = [m for m in list(agent.models) if hasattr(m, "register_forward_pre_hook")]
        if not self._roots:
            from torch.nn.modules.module import register_module_forward_pre_hook

            self._discovery = register_module_forward_pre_hook(self._discover)
        elif self._due():  # the first step is a profiled one: no eve comes before it
            self._arm()
        self._ask()

    def stop(self) -> None:
        if self._discovery is not None:
            self._discovery.remove()
            self._discovery = None
        self._disarm()
        self._reset()
        self._roots = []

    # --- the hooks, armed for a profiled step only ----------------------------------------------
    # A hook on the model's forward and on optimizer steps costs every step ~1 µs (and the module's
    # slower call path) even when it returns at once: they are put in at the end of the step before a
    # profiled one (``on_eve``, which the profiled step end's request brings) and taken out at its end.

    def _ask(self) -> None:
        """Have the next profiled step's end sampled in full, and so its eve called."""
        if self._agent is not None and not self._failed:
            self._agent.sample_within(self._every - self._agent.steps_total % self._every)

    def on_eve(self) -> None:
        if not self._handles and self._due():
            self._arm()

    def _due(self) -> bool:
        """Is the step under way (or the next, from a step end) a profiled one?"""
        agent = self._agent
        return agent is not None and not self._failed and (agent.steps_total + 1) % self._every == 0

    def _arm(self) -> None:
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        self._handles.append(register_optimizer_step_pre_hook(self._on_optimizer_pre))
        for root in self._roots:
            self._hook_root(root)

    def _hook_root(self, module: Any) -> None:
        self._handles.append(module.register_forward_pre_hook(self._on_forward_start))
        self._handles.append(module.register_forward_hook(self._on_forward_end, always_call=True))

    def _disarm(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    # --- hooks (training thread; never raise into the job) -----------------------------------

    def _discover(self, module: Any, args: Any) -> None:
        try:
            if next(iter(module.parameters()), None) is None:
                return  # a loss or a parameterless helper is not the model
            if self._discovery is not None:
                self._discovery.remove()
                self._discovery = None
            self._roots.append(module)
            if self._handles:  # armed already (this step is a profiled one): the new root too
                self._hook_root(module)
            elif self._due():  # the first step, profiled: no eve came before it
                self._arm()
        except Exception as exc:  # noqa: BLE001 - the job comes first
            self._fail("model discovery", exc)
            return
        self._on_forward_start(module, args)  # the per-instance hook starts with the next call

    def _on_forward_start(self, module: Any, args: Any) -> None:
        agent = self._agent
        if self._state != _IDLE or agent is None or not agent.running or not self._due():
            return
        t0 = time.perf_counter()
        try:
            from gpumemd.probes.planning.trace import SavedTensorCounter

            params = list(module.parameters())
            buffers = list(module.buffers())
            device = params[0].device if params else None
            self._root = module
            self._device = Device.parse(str(device)) if device is not None else CPU
            self._cuda_index = _cuda_index(device)
            self._values["parameter_bytes"] = _tensor_bytes([*params, *buffers])
            self._values["forward_start_bytes"] = self._allocated(reset_peak=True)
            self._counter = SavedTensorCounter(exclude=[*params, *buffers])
            self._counter.start()
            self._state = _FORWARD
            agent.sample_within(1)  # this step's end must be a sampled one: on_step finishes it
        except Exception as exc:  # noqa: BLE001 - the job comes first
            self._fail("forward start", exc)
        self._overhead += time.perf_counter() - t0

    def _on_forward_end(self, module: Any, args: Any, output: Any) -> None:
        if self._state != _FORWARD or module is not self._root:
            return
        t0 = time.perf_counter()
        try:
            if self._counter is not None:
                self._counter.stop()
            if output is None:  # always_call hooks see None when the forward raised: discard
                self._reset()
            else:
                self._values["forward_peak_bytes"] = self._peak()
                self._state = _BACKWARD
        except Exception as exc:  # noqa: BLE001
            self._fail("forward end", exc)
        self._overhead += time.perf_counter() - t0

    def _on_optimizer_pre(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self._state != _BACKWARD:
            return
        t0 = time.perf_counter()
        try:
            self._values["after_backward_bytes"] = self._allocated(reset_peak=True)
            root = self._root
            grads = [p.grad for p in root.parameters() if p.grad is not None] if root is not None else []
            self._values["gradient_bytes"] = _tensor_bytes(grads)
            self._state = _STEP
        except Exception as exc:  # noqa: BLE001
            self._fail("optimizer step", exc)
        self._overhead += time.perf_counter() - t0

    def on_step(self, record: StepRecord) -> None:
        if self._state != _IDLE:
            try:
                self._finish(record)
            except Exception as exc:  # noqa: BLE001 - the job comes first
                self._fail("step end", exc)
        if self._agent is not None and (self._agent.steps_total + 1) % self._every:
            self._disarm()  # the profiled step is over (or its forward never came)
        self._ask()  # a full step end meets every request: ask again for the next profiled one

    def _finish(self, record: StepRecord) -> None:
        if self._state == _FORWARD and self._counter is not None:
            self._counter.stop()  # the forward never returned to us; keep the hooks bounded
        t0 = time.perf_counter()
        values = self._values
        if self._state == _STEP:
            values["optimizer_step_peak_bytes"] = self._peak()
        values["after_step_bytes"] = self._allocated(reset_peak=False)
        agent = self._agent
        optimizers = list(agent.optimizers) if agent is not None else []
        values["optimizer_state_bytes"] = _optimizer_state_bytes(optimizers) if optimizers else None
        counter = self._counter
        profile = StepProfile(
            step=record.step,
            device=self._device,
            forward_start_bytes=values.get("forward_start_bytes"),
            forward_peak_bytes=values.get("forward_peak_bytes"),
            after_backward_bytes=values.get("after_backward_bytes"),
            after_step_bytes=values.get("after_step_bytes"),
            saved_for_backward_bytes=counter.bytes if counter is not None else 0,
            saved_tensors=counter.saved if counter is not None else 0,
            optimizer_step_peak_bytes=values.get("optimizer_step_peak_bytes"),
            parameter_bytes=values.get("parameter_bytes"),
            gradient_bytes=values.get("gradient_bytes"),
            optimizer_state_bytes=values.get("optimizer_state_bytes"),
            overhead_s=self._overhead + (time.perf_counter() - t0),
        )
        hooks_seconds = self._overhead  # the hooks ran outside the step end, whose own time is clocked already
        self._reset()
        if agent is not None:
            agent.add_thread_seconds(hooks_seconds)  # the agent's own figure counts them
            agent.publish(step_profile=profile)

    # --- readings ------------------------------------------------------------------------------

    def _allocated(self, *, reset_peak: bool) -> int | None:
        stat = self._allocated_stat()
        if stat is None:
            return None
        if reset_peak:
            import torch

            torch.cuda.reset_peak_memory_stats(self._cuda_index)
        return int(stat["current"])

    def _peak(self) -> int | None:
        stat = self._allocated_stat()
        return int(stat["peak"]) if stat is not None else None

    def _allocated_stat(self) -> Any:
        """The allocator's ``allocated_bytes.all`` stat, from the nested dict torch's binding returns:
        ``memory_allocated()`` and ``max_memory_allocated()`` call ``memory_stats()``, which flattens and
        sorts all of it in Python (78 µs a call on an H200, against 12 µs for the nested dict)."""
        if self._cuda_index is None:
            return None
        import torch

        return torch.cuda.memory.memory_stats_as_nested_dict(self._cuda_index)["allocated_bytes"]["all"]

    def _fail(self, where: str, exc: BaseException) -> None:
        self._reset()
        self._disarm()
        self._failed = True  # one failure turns the component off: the job comes first
        log.warning("gpumemd: the step profile failed at %s (%s: %s); it is off for this run",
                    where, type(exc).__name__, exc)


def _cuda_index(device: Any) -> int | None:
    if device is None or getattr(device, "type", None) != "cuda":
        return None
    import torch

    return device.index if device.index is not None else torch.cuda.current_device()


def _tensor_bytes(tensors: list[Any]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views and tied weights once)."""
    from gpumemd.probes.planning.trace import storage_key, storage_nbytes

    seen: set[int] = set()
    total = 0
    for t in tensors:
        key = storage_key(t)
        if key is not None:
            if key in seen:
                continue
            seen.add(key)
        total += storage_nbytes(t)
    return total


def _optimizer_state_bytes(optimizers: list[Any]) -> int:
    import torch

    tensors = [
        value
        for opt in optimizers
        for state in getattr(opt, "state", {}).values()
        for value in (state.values() if isinstance(state, dict) else ())
        if isinstance(value, torch.Tensor)
    ]
    return _tensor_bytes(tensors)
