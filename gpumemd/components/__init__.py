"""Capabilities plugged into the agent. Each module holds one component class (see
``gpumemd.agent.Component``); ``build_default`` lists the ones a normal ``attach()`` starts.

Start order matters (the leak detector reads the census component; the exporter starts last so it
never serves a half-started agent); the agent stops them in reverse order.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gpumemd.agent import Component
    from gpumemd.config import Config


def build_default(config: Config) -> list[Component]:
    components: list[Component] = []
    # Each capability appends itself here, in start order, guarded by its Config switch.
    if config.census:  # first: the leak detector and the OOM report read its censuses
        from gpumemd.components.census import CensusComponent

        components.append(CensusComponent(config))
    if config.leak_detection:  # after census: it reads the published censuses for its series and culprits
        from gpumemd.components.leak import LeakComponent

        components.append(LeakComponent())
    if config.phases:  # opt-in; sampled steps only
        from gpumemd.components.phases import PhasesComponent

        components.append(PhasesComponent(config.phase_every_steps))
    if config.oom_reports:  # after census/leak (the report reads them); before the exporter
        from gpumemd.components.oom import OomComponent

        components.append(OomComponent(config))
    # The exporter stays LAST: it starts after everything it exports and stops first.
    from gpumemd.components import exporter

    if exporter.enabled(config):
        components.append(exporter.ExporterComponent())
    return components
