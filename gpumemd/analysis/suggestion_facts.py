"""What the suggestion rules read after an OOM (pure): the measurements, and the shape of a rule.

``analysis.suggestions`` holds the rules and orders what they suggest; ``analysis.capacity_rules``
the rules of a capacity OOM. Both read these ``Facts``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from gpumemd.records.census import TensorEntry
from gpumemd.records.findings import Finding
from gpumemd.records.oom import Breakdown, Suggestion


@dataclass(frozen=True)
class Facts:
    """What the rules read: the breakdown (with the leak at the OOM, if any), the leak findings, the
    phase the OOM happened in, and whether the allocator already has expandable segments."""

    breakdown: Breakdown
    findings: Sequence[Finding] = ()
    phase: str = "train"
    expandable_segments: bool | None = None
    largest: Sequence[TensorEntry] = ()  # the census's largest storages at the OOM

    @property
    def used(self) -> int:
        return self.breakdown.tensor_bytes

    @property
    def acts(self) -> int:
        return self.breakdown.activations_bytes

    def share(self, part: int) -> float:
        return part / self.used if self.used else 0.0


Rule = Callable[[Facts], list[Suggestion]]
