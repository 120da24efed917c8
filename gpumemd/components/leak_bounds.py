"""Growth into a bounded deque (``deque(maxlen=N)``) that holds a leak finding's sample: withheld while the
deque fills, since a full one adds nothing. The culprit search (``leak_culprits``) finds the deque with
the sample's holder and asks here until when to withhold the finding, and whether the group already
counts more than filling the deque explains (another holder's growth)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gpumemd.analysis.leak_detector import TrackStatus
    from gpumemd.components.leak_series import LeakSeries


class DequeBounds:
    """Per count series held by a filling bounded deque, the most its group counts once the deque is full."""

    def __init__(self, series: LeakSeries) -> None:
        self._series = series
        self._ceilings: dict[tuple[str, str], int] = {}

    def until(self, status: TrackStatus, bound: tuple[int, int] | None, count: int,
              bytes_per_unit: float) -> int | None:
        """Until when growth into the bounded deque that holds the sample is withheld (``bound``: its
        maxlen and length; ``count``: the group's tensors now). While it fills: half a window past the
        step it is full by at the group's rate, if what it adds until then fits half the headroom (a
        bound past the memory left is no bound). Full, it adds nothing: a window more, unless the group
        counts more than filling it explains (``_ceilings``), which is another holder's growth. None:
        growth no bound explains."""
        key = (status.spec.name, status.phase)
        ceiling = self._ceilings.pop(key, None)
        rate = self._series.stated_rate(status)
        if bound is None or rate <= 0:
            return None
        maxlen, length = bound
        window = self._series.detector.config.window_steps
        if length < maxlen:
            # An item may hold several of the group's tensors (a tuple of outputs): the deque fills at
            # the group's rate over that many, not at its rate (a 4-tensor item read 4x too soon as full).
            per_item = max(1, round(count / length)) if length else 1
            steps = math.ceil((maxlen - length) * per_item / rate)
            headroom = self._series.headroom(status.spec)
            if headroom is not None and steps * rate * bytes_per_unit > headroom / 2:
                return None
            self._ceilings[key] = count + (maxlen - length) * per_item
            return status.step + steps + window // 2
        if self.past(status, count, ceiling):
            return None
        self._ceilings[key] = count if ceiling is None else ceiling  # full when first seen: now is its share
        return status.step + window

    def past(self, status: TrackStatus, count: int, ceiling: int | None = None) -> bool:
        """Does the group count more than filling its bounded deque explains (``_ceilings``)?"""
        if ceiling is None:
            ceiling = self._ceilings.get((status.spec.name, status.phase))
        return ceiling is not None and count > ceiling + ceiling // 8 + 16
