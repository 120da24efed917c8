"""What the culprit search found behind one finding: the record passed from the search to the wording."""

from __future__ import annotations

import dataclasses

from gpumemd.records.findings import Culprit


@dataclasses.dataclass(frozen=True, slots=True)
class Evidence:
    """Culprits over ``steps``, CUDA sites, and a kind when the evidence decides it (a growing
    autograd graph behind host growth is a graph leak)."""

    culprits: tuple[Culprit, ...] = ()
    steps: float = 0.0
    sites: tuple[str, ...] = ()
    kind: str | None = None
    bytes_per_unit: float = 1.0  # count series: bytes one tensor costs (its storage and its graph)
    sentence: str | None = None  # the culprit sentence: a count series', or what a host leak's search ruled out
    graph_kept: bool = False  # count series: no Python holder; an autograd graph keeps them
    garbage: bool = False  # count series: unreachable cycles the (enabled) collector will free
    onset_step: int | None = None  # when the evidence dates the start (a container's length / its rate)
    bounded_until: int | None = None
    """Growth that stops on its own: a count series whose sample a bounded deque (``deque(maxlen=N)``)
    holds while it fills, or host RSS the heap's fragmentation explains (``fragmented``). The finding is
    withheld, and its culprits looked for again at this step (``CulpritSearch``, ``HostLooks``)."""
    fragmented: bool = False  # host RSS grew while malloc's bytes in use did not (``HostLooks._fragmented``)


NO_EVIDENCE = Evidence()
