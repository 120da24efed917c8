"""Memory measured at the phases of one sampled training step."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class PhaseBreakdown:
    """Bytes on the job's device at each phase boundary of one sampled step."""

    step: int
    device: str
    forward_start_bytes: int
    forward_peak_bytes: int | None
    after_backward_bytes: int
    after_step_bytes: int
    saved_for_backward_bytes: int

    @property
    def activations_bytes(self) -> int:
        return self.saved_for_backward_bytes
