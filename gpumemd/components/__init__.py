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
    return components
