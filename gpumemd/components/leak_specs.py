"""The leak series' specs: each series' name, kind and device, and what accounts for its growth. The
fixed measures' specs are cached (the per-step path builds none); a group's spec is made once, when
its count series starts."""

from __future__ import annotations

from typing import TYPE_CHECKING

from gpumemd.analysis.leak_detector import SeriesSpec
from gpumemd.analysis.leak_types import series_family, series_name

if TYPE_CHECKING:
    from gpumemd.probes.survival.graph_chains import ChainGroup
    from gpumemd.probes.survival.survivor_counts import SurvivorGroup
    from gpumemd.probes.survival.tensor_families import Family
    from gpumemd.records.device import Device


_SPECS: dict[tuple[str, Device, bool, bool], SeriesSpec] = {}


def measure_spec(measure: str, kind: str, device: Device, *, sparse: bool = False, alarm: bool = True) -> SeriesSpec:
    """The spec of series ``measure`` on ``device``."""
    # Specs are immutable and few: cache them so the per-step path builds nothing (not even the name).
    key = (measure, device, sparse, alarm)
    spec = _SPECS.get(key)
    if spec is None:
        spec = SeriesSpec(series_name(measure, device), kind, device, sparse=sparse, alarm=alarm,
                          explained_by=_explained_by(measure, device))
        if len(_SPECS) < 1024:
            _SPECS[key] = spec
    return spec


def _explained_by(measure: str, device: Device) -> tuple[str, ...]:
    """What accounts for a series' growth when it grows as fast: the device's long-lived tensors, for
    its allocated bytes."""
    if measure != "allocated_bytes":
        return ()
    return (series_name("long_lived_bytes", device), series_family("tensors", device),
            series_family("growing_tensor_bytes", device))


def tensor_spec(group: SurvivorGroup) -> SeriesSpec:
    """The count series of a survivor group."""
    described = group.describe()
    return SeriesSpec(series_name("tensors", group.device, described),
                      "graph_leak" if group.graph else "tensor_leak", group.device, sparse=True,
                      unit="tensors", group=described,
                      # a tensor with a grad_fn keeps its graph: its bytes are more than its own
                      unit_bytes=0.0 if group.graph else group.nbytes / max(1, group.count))


def chain_spec(group: ChainGroup) -> SeriesSpec:
    """The node-count series of a graph-chain group."""
    described = group.describe()
    return SeriesSpec(series_name("graph_nodes", group.device, described), "graph_leak", group.device,
                      sparse=True, unit="nodes", group=described)


def family_spec(family: Family) -> SeriesSpec:
    """The bytes series of a growing tensor's family."""
    described = family.describe()
    return SeriesSpec(series_name("growing_tensor_bytes", family.device, described),
                      "graph_leak" if family.key[3] else "tensor_leak", family.device, sparse=True,
                      group=described, row_bytes=family.row_bytes)
