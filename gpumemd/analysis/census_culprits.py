"""The culprits of a census diff (pure: no torch, no I/O): the groups that grew most, the tensors only
an autograd graph keeps charged to the graph's root, the kind they make a tensor leak, and the
sentence that names the first ("+1 tensor/step: float32[] with grad_fn, held by list `losses`,
keeping ~3 MiB/step of autograd graph alive").
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

from gpumemd.analysis.units import format_bytes
from gpumemd.records.census import GroupDelta, GroupKey
from gpumemd.records.findings import Culprit


def describe_key(key: GroupKey) -> str:
    """``float32[64, 256] with grad_fn`` / ``Adam[fc.weight].exp_avg float32[64, 256]`` /
    ``fc.bias float32[8] (parameter)``: the words leak culprits and the OOM report's leak use for a
    census group, so that one finds the other's group by them."""
    text = f"{key.dtype.removeprefix('torch.')}[{', '.join(str(d) for d in key.shape)}]"
    if key.category == "graph":
        text += " with grad_fn"
    elif key.category != "other":
        text += f" ({key.category})"
    return f"{key.name} {text}" if key.name else text


def fold_graph_groups(deltas: Iterable[GroupDelta]) -> list[GroupDelta]:
    """Charge tensors that only an autograd graph keeps (category graph, no Python holder: saved
    activations whose wrapper torch preserved) to the held graph tensor that grew in count — the
    loss kept in a list — as its graph bytes: "+1 tensor/step: float32[] with grad_fn, held by list
    `losses`, keeping ~3 MiB/step of autograd graph alive"."""
    deltas = list(deltas)
    kept = [d for d in deltas if _graph_kept(d.key.category, d.holder) and d.bytes_delta > 0]
    roots = [d for d in deltas if d.key.category == "graph" and not _graph_kept(d.key.category, d.holder)
             and d.count_delta > 0]
    if not kept or not roots:
        return deltas
    root = max(roots, key=lambda d: (d.count_delta, d.bytes_delta))
    extra = sum(d.bytes_delta + d.graph_bytes_delta for d in kept)
    folded = dataclasses.replace(root, graph_bytes_delta=root.graph_bytes_delta + extra)
    return [folded, *(d for d in deltas if d is not root and d not in kept)]


def culprits_from_diff(deltas: Iterable[GroupDelta], *, limit: int = 3) -> tuple[Culprit, ...]:
    """The groups that grew most (own bytes plus graph bytes), as culprits."""
    ranked = sorted(
        (d for d in fold_graph_groups(deltas) if d.bytes_delta + d.graph_bytes_delta > 0),
        key=lambda d: (d.bytes_delta + d.graph_bytes_delta, d.count_delta), reverse=True,
    )
    return tuple(
        Culprit(description=describe_key(d.key), count_delta=d.count_delta, bytes_delta=d.bytes_delta,
                holder=d.holder, graph_bytes_delta=d.graph_bytes_delta, category=d.key.category)
        for d in ranked[:limit]
    )


_GRAPH_HOLDERS = ("autograd graph of ", "an autograd graph")  # how the census names graph-kept tensors


def _graph_kept(category: str | None, holder: str | None) -> bool:
    """Tensors with a grad_fn that no Python object holds: autograd keeps them (saved activations
    whose Python wrapper torch preserved), so their bytes are graph bytes."""
    return category == "graph" and (holder is None or holder.startswith(_GRAPH_HOLDERS))


def refine_kind(kind: str, culprits: Sequence[Culprit]) -> str:
    """A tensor leak whose growth is mostly autograd graph kept alive is a graph leak."""
    if kind != "tensor_leak" or not culprits:
        return kind
    graph = sum(max(0, c.graph_bytes_delta) + (max(0, c.bytes_delta) if _graph_kept(c.category, c.holder) else 0)
                for c in culprits)
    own = sum(max(0, c.bytes_delta) for c in culprits if not _graph_kept(c.category, c.holder))
    return "graph_leak" if graph > own else kind


def culprit_sentence(c: Culprit, steps: float) -> str:
    """'+1 tensor/step: float32[] with grad_fn, held by list `losses` (...), keeping ~3.1 MiB/step of
    autograd graph alive' — rates over the ``steps`` the census diff spans."""
    if steps < 1:
        # No interval to divide by (both censuses at one step): a count, never a made-up rate.
        text = f"+{c.count_delta:,} {c.noun}s: {c.description}, {format_bytes(c.bytes_delta + c.graph_bytes_delta)}"
        return text + (f", held by {c.holder}" if c.holder else ", holder not found")
    rate = c.count_delta / steps
    if c.count_delta <= 0:
        head = f"+0 {c.noun}s"
    elif rate >= 0.5:
        n = max(1, round(rate))
        head = f"+{n} {c.noun}{'s' if n != 1 else ''}/step"
    else:
        head = f"+1 {c.noun} every {steps / c.count_delta:.0f} steps"
    if _graph_kept(c.category, c.holder):
        # saved activations: what matters is the graph that keeps them and who holds its root
        holder = c.holder or "an autograd graph (its root's holder was not found)"
        return (f"{head.replace(c.noun, 'saved ' + c.noun, 1)}: {c.description} "
                f"(~{format_bytes(c.bytes_delta / steps)}/step), kept alive by {_the(holder)}")
    text = f"{head}: {c.description}"
    if c.bytes_delta < c.graph_bytes_delta:
        pass  # the graph is the story; the tensors' own bytes would only distract
    elif c.bytes_delta > 0 and c.count_delta > 0:
        text += f" (~{format_bytes(c.bytes_delta / steps)}/step)"
    elif c.bytes_delta > 0:
        text += f" growing ~{format_bytes(c.bytes_delta / steps)}/step"
    text += f", held by {c.holder}" if c.holder else ", holder not found"
    if c.graph_bytes_delta / steps >= 1:
        text += f", keeping ~{format_bytes(c.graph_bytes_delta / steps)}/step of autograd graph alive"
    return text


def _the(holder: str) -> str:
    return "the " + holder if holder.startswith("autograd graph") else holder
