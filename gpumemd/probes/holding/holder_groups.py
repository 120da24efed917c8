"""Holders for a census's groups: which few groups are worth a holder look-up, and one look-up each
within a shared budget (``probes.holding.holders.who_holds`` climbs; this chooses what it climbs from).

``fill_holders`` names the largest and fastest-growing groups of a census and the objects that own
them; ``holder_of_group`` finds a group again by its key (a leak's culprit) and names its holder.
"""

from __future__ import annotations

import gc
import time
from typing import TYPE_CHECKING

from gpumemd.probes.holding.holders import HOLDER_BUDGET_S, cycle_holder, who_holds
from gpumemd.records.census import Census, CensusGroup, GroupKey

if TYPE_CHECKING:
    import torch


def holder_of_group(key: GroupKey) -> str | None:
    """Who holds a live tensor of this census group (the census looks holders up only for groups
    whose count grew; a retained graph grows behind one tensor)."""
    import torch  # lazily: `import gpumemd` stays light

    deadline = time.monotonic() + HOLDER_BUDGET_S
    sample = None
    for i, obj in enumerate(gc.get_objects()):
        if i % 4096 == 0 and time.monotonic() > deadline:
            return None
        if type(obj) is not torch.Tensor:  # exact type: cheap, and parameters are never culprits here
            continue
        try:
            if (tuple(obj.shape) == key.shape and str(obj.dtype).removeprefix("torch.") ==
                    key.dtype.removeprefix("torch.") and str(obj.device) == key.device.name
                    and (key.category != "graph" or obj.grad_fn is not None)):
                sample = obj
                break
        except Exception:  # noqa: BLE001 - an odd tensor subclass must not stop the search
            continue
    if sample is None:
        return None
    try:
        return who_holds(sample, time_budget_s=max(0.05, deadline - time.monotonic())) or cycle_holder(sample)
    finally:
        del sample


def fill_holders(
    groups: list[CensusGroup],
    samples: dict[GroupKey, torch.Tensor],
    owners: dict[GroupKey, torch.Tensor],
    *,
    holders: int,
    previous: Census | None,
    budget_s: float,
    largest_too: bool = False,
) -> list[CensusGroup]:
    """A census's groups with ``holder`` set for the few that need it: the ``holders`` anonymous
    groups that grew most since ``previous`` (or the largest ones, without it), looked up through
    a sample tensor of each (``samples``), all lookups together within ``budget_s``; ``largest_too``: up to
    ``holders`` groups in all, the largest anonymous ones after those that grew.

    A tensor that only an autograd graph keeps (a saved activation) has no gc referrer: it is
    described as ``autograd graph of <who holds the tensor that keeps the graph>`` (``owners``)."""
    chosen = _groups_to_look_up(groups, holders, previous)
    if largest_too:
        chosen += [g for g in groups if g.key.name is None and g not in chosen][:holders - len(chosen)]
    if not chosen:
        return groups
    deadline = time.monotonic() + budget_s
    found: dict[GroupKey, str] = {}
    owner_lines: dict[int, str | None] = {}
    for group in chosen:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        sample = samples.get(group.key)
        if sample is None:
            continue
        holder = who_holds(sample, time_budget_s=remaining, ignore=(samples, owners))
        del sample
        owner = owners.get(group.key)
        if holder is None and owner is not None:
            if id(owner) not in owner_lines:
                remaining = max(0.0, deadline - time.monotonic())
                owner_lines[id(owner)] = who_holds(owner, time_budget_s=remaining, ignore=(samples, owners))
            line = owner_lines[id(owner)]
            holder = f"autograd graph of {line}" if line else "an autograd graph"
        del owner
        if holder is not None:
            found[group.key] = holder
    return [
        CensusGroup(g.key, g.count, g.nbytes, g.graph_bytes, found[g.key]) if g.key in found else g
        for g in groups
    ]


def _groups_to_look_up(groups: list[CensusGroup], holders: int, previous: Census | None) -> list[CensusGroup]:
    """The anonymous groups that grew most since ``previous`` (in count or bytes), or the largest."""
    anonymous = [g for g in groups if g.key.name is None]
    if previous is None:
        return anonymous[:holders]
    before = {g.key: g for g in previous.groups}

    def growth(g: CensusGroup) -> int:
        old = before.get(g.key)
        return g.nbytes + g.graph_bytes - (old.nbytes + old.graph_bytes if old else 0)

    grown = [(growth(g), g) for g in anonymous if g.count > getattr(before.get(g.key), "count", 0)
             or growth(g) > 0]
    grown.sort(key=lambda pair: pair[0], reverse=True)
    return [g for _, g in grown[:holders]]
