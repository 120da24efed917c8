"""The culprit sentences the leak component writes from what it measured itself (pure: no torch, no I/O).

A count series' tensors ("+1 tensor/step: float32[4, 128] (~2.0 KiB/step), held by `kept` in main()
at train.py:12 → list of 1,204 items"), a tensor replaced each step by a larger copy, a chain of
graphs, DataLoader workers; and the count per step they, and ``analysis.leak_wording``, state.
"""

from __future__ import annotations

from collections.abc import Sequence

from gpumemd.analysis.leak_headline import since_words
from gpumemd.analysis.units import format_bytes


def units_per_step(per_step: float, noun: str) -> str:
    """"+1 tensor/step", "+64 rows/step", "+0.5 tensors/step": a count per step, in whole units once it
    is about one or more (``_count``)."""
    n = _count(per_step)
    return f"+{n} {noun}{'' if n == '1' else 's'}/step"


def _count(per_step: float) -> str:
    """1 for 0.98 tensors/step (a count series is exact up to its sampling), 0.5 for 0.5."""
    return f"{round(per_step):,}" if per_step >= 0.95 else f"{per_step:.2g}"


def count_sentence(per_step: float, description: str, own_bytes: float, graph_bytes: float,
                   holder: str | None, *, graph_nodes: int = 0) -> str:
    """The culprit sentence of a count series, written from the tensors themselves: '+1 tensor/step:
    float32[4, 128] (~2.0 KiB/step), held by `kept` in main() at train.py:12 → list of 1,204 items'.
    ``graph_nodes``: the autograd nodes one of them keeps alive when backward() freed what they saved
    (the nodes still hold host memory, which this process's RSS shows rather than any tensor)."""
    text = f"{units_per_step(per_step, 'tensor')}: {description} (~{format_bytes(per_step * own_bytes)}/step"
    if graph_bytes:
        text += f", keeping ~{format_bytes(per_step * graph_bytes)}/step of autograd graph alive"
    elif graph_nodes > 1:
        text += (f", each keeping its autograd graph of {graph_nodes:,} nodes alive: backward() freed its "
                 "saved tensors, the nodes stay in host memory")
    return text + ")" + (f", held by {holder}" if holder else ", holder not found")


def growth_sentence(holder: str | None, description: str, rows_per_step: float, row_bytes: int,
                    rows_now: int) -> str:
    """The culprit sentence of a tensor replaced each step by a larger one: '`all_logits` in
    evaluate() at eval.py:30 grows +64 rows/step (~2.5 KiB/step): float32[N, 10], 19,200 rows
    (750.0 KiB) now, a larger copy every step (torch.cat onto the kept tensor): ...'."""
    who = holder if holder else f"a {description} tensor (holder not found)"
    return (f"{who} grows {rows_rate(rows_per_step, row_bytes)}: {description}, {rows_now:,} rows "
            f"({format_bytes(rows_now * row_bytes)}) now, replaced by a larger copy every step "
            "(torch.cat onto the kept tensor): append the parts to a list and cat once, "
            "move them to the CPU or reset it each epoch, or keep a running metric instead")


def workers_noun(pids: Sequence[int], dataloader: bool) -> str:
    """'DataLoader workers (2, pids 4120, 4121)', 'child processes (1, pid 4120)'."""
    shown = ", ".join(str(p) for p in pids[:6]) + (", …" if len(pids) > 6 else "")
    noun = "DataLoader workers" if dataloader else "child processes"
    return f"{noun} ({len(pids)}, pid{'s' if len(pids) != 1 else ''} {shown})"


def workers_holder(pids: Sequence[int], datasets: Sequence[str]) -> str:
    """What a workers finding names where others name a holder: 'DataLoader workers (2, pids 41, 42)
    running CachingDataset'."""
    text = workers_noun(pids, bool(datasets))
    return text + f" running {', '.join(datasets)}" if datasets else text


def workers_sentence(pids: Sequence[int], per_worker: float, onset_step: int | None,
                     loaders: Sequence[tuple[str, bool | None]]) -> str:
    """'DataLoader workers (2, pids 4120, 4121) +300.0 KiB/step each since step 120, running
    CachingDataset (train.data) with persistent_workers=True: ...' and what to try."""
    text = f"{workers_noun(pids, bool(loaders))} +{format_bytes(per_worker)}/step each"
    if onset_step is not None:
        text += f" {since_words(onset_step)}"
    text += " while the training process stays flat"
    if loaders:
        runs = "; ".join(f"{name}{'' if persistent is None else f', persistent_workers={persistent}'}"
                         for name, persistent in loaders)
        text += f", running {runs}"
    return (text + ": a cache in the Dataset fills in every worker: bound it (an LRU of fixed size) or "
            "fill it before the workers start; Python lists and dicts the Dataset holds are copied into "
            "each worker as it reads them (copy-on-read): hold numpy arrays or tensors instead")


def rows_rate(rows_per_step: float, row_bytes: int) -> str:
    """'+64 rows/step (~2.5 KiB/step)'."""
    return f"{units_per_step(rows_per_step, 'row')} (~{format_bytes(rows_per_step * row_bytes)}/step)"


def chain_sentence(description: str, graph_nodes: int, saved_per_step: float, holder: str | None, *,
                   at_least: bool = False) -> str:
    """The culprit sentence of a graph chain: 'every step's graph stays chained to float32[] held by
    `epoch_loss` in train() at train.py:57 (graph of 3,001 nodes now; backward() freed their saved
    tensors, the nodes stay): accumulate `.item()` or `.detach()`, not the tensor with its graph'.
    ``at_least``: the count stopped at ``graph_nodes`` ("20,000+ nodes")."""
    nodes = f"{graph_nodes:,}{'+' if at_least else ''}"
    text = (f"every step's graph stays chained to {description}"
            f"{f' held by {holder}' if holder else ' (holder not found)'} (graph of {nodes} nodes now; ")
    if saved_per_step >= 1:
        text += f"its saved tensors grow ~{format_bytes(saved_per_step)}/step)"
    else:
        text += "backward() freed their saved tensors, the nodes stay)"
    return text + ": accumulate `.item()` or `.detach()`, not the tensor with its graph"
