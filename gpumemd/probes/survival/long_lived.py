"""The long-lived tensor probes a leak component starts with: the survivor tracker (count series), the
graph chain tracker and the tensor families. ``api.build_agent`` hands the component this factory, as
it builds every other probe; the component calls it at each start, since a restarted detector needs
fresh trackers (an earlier one's counts and weak references stay with it)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from gpumemd.probes.survival.graph_chains import GraphChainTracker
from gpumemd.probes.survival.survivors import SurvivorTracker
from gpumemd.probes.survival.tensor_families import TensorFamilies

log = logging.getLogger("gpumemd")


@dataclass(frozen=True, slots=True)
class LongLivedProbes:
    """Each None when tracking cannot run here (the bytes series still judge)."""

    tracker: SurvivorTracker | None
    chains: GraphChainTracker | None
    families: TensorFamilies | None


def long_lived_probes() -> LongLivedProbes:
    """New trackers, the survivor tracker's gc callback installed; none when that fails."""
    try:
        tracker = SurvivorTracker()
        tracker.install()
        return LongLivedProbes(tracker, GraphChainTracker(), TensorFamilies())
    except Exception as exc:  # noqa: BLE001 - no count evidence then; bytes series still run
        log.info("gpumemd: long-lived tensor tracking is off (%s: %s)", type(exc).__name__, exc)
        return LongLivedProbes(None, None, None)
