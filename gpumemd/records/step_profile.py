"""The step profile: memory measured at the points of one sampled training step."""

from __future__ import annotations

from dataclasses import dataclass

from gpumemd.records.device import Device


@dataclass(frozen=True, slots=True)
class StepProfile:
    """One sampled step, point by point (bytes).

    Device figures (``*_bytes`` of the allocator: forward start, forward peak, after backward,
    after the optimizer step, optimizer-step peak) come from the CUDA caching allocator and are
    ``None`` on CPU, where no allocator statistic exists that could be read honestly.
    ``saved_for_backward_bytes`` (counted by saved-tensor hooks, storages deduplicated, parameters
    excluded) and the tensor terms (parameters + buffers, gradients, optimizer state; exact, from
    the model and optimizers) are measured on every device.
    """

    step: int
    device: Device
    forward_start_bytes: int | None
    forward_peak_bytes: int | None
    after_backward_bytes: int | None
    after_step_bytes: int | None
    saved_for_backward_bytes: int
    saved_tensors: int = 0
    optimizer_step_peak_bytes: int | None = None
    parameter_bytes: int | None = None
    gradient_bytes: int | None = None
    optimizer_state_bytes: int | None = None
    overhead_s: float = 0.0  # the agent's own time on this step's hooks (training thread)

    @property
    def optimizer_step_transient_bytes(self) -> int | None:
        """Temporaries of ``optimizer.step()``: its peak above the memory it started from."""
        if self.optimizer_step_peak_bytes is None or self.after_backward_bytes is None:
            return None
        return max(0, self.optimizer_step_peak_bytes - self.after_backward_bytes)

    @property
    def forward_transient_bytes(self) -> int | None:
        """How far the forward rose above its start (activations plus temporaries)."""
        if self.forward_peak_bytes is None or self.forward_start_bytes is None:
            return None
        return max(0, self.forward_peak_bytes - self.forward_start_bytes)

    def figures(self) -> dict[str, int]:
        """The measured figures by name, leaving out those that are absent (for exporters and
        reports: a missing figure is left out, never exported as 0)."""
        values: dict[str, int | None] = {
            "forward_start": self.forward_start_bytes,
            "forward_peak": self.forward_peak_bytes,
            "after_backward": self.after_backward_bytes,
            "after_step": self.after_step_bytes,
            "optimizer_step_peak": self.optimizer_step_peak_bytes,
            "saved_for_backward": self.saved_for_backward_bytes,
            "parameters": self.parameter_bytes,
            "gradients": self.gradient_bytes,
            "optimizer_state": self.optimizer_state_bytes,
            "forward_transient": self.forward_transient_bytes,
            "optimizer_step_transient": self.optimizer_step_transient_bytes,
        }
        return {name: value for name, value in values.items() if value is not None}
