"""The host-side culprit probes: Python containers that gain items, autograd graphs that gain nodes."""

from __future__ import annotations

import torch

from gpumemd.probes.heap.host_objects import (
    ContainerGrowth,
    container_lengths,
    growing_containers_stepwise,
    growing_graph,
    largest_graph_nodes,
)
from gpumemd.probes.heap.stepwise import run_to_end


def growing_containers(before: dict[int, int], ignore: frozenset[int] = frozenset()) -> list[ContainerGrowth]:
    """The whole search at once, as a caller that can pause the job runs it."""
    return run_to_end(growing_containers_stepwise(before, ignore=ignore, holder_budget_s=0.5))


def test_growing_list_of_bytes_is_found_and_named() -> None:
    raw_buffers = [b"x" * 1000 for _ in range(10)]
    steady = list(range(50))
    before = container_lengths()
    raw_buffers.extend(b"y" * 4096 for _ in range(20))
    steady[0] = -1
    grown = growing_containers(before)
    top = grown[0]
    assert (top.type_name, top.item_type, top.items_added) == ("list", "bytes", 20)
    assert top.approx_bytes >= 20 * 4096
    assert top.holder is not None and "raw_buffers" in top.holder
    assert all(g.items_added >= 4 for g in grown)  # the list that only changed an item is not there
    # the caller's own buffers can be left out
    assert all(g.type_name != "list" or g.item_type != "bytes"
               for g in growing_containers(before, ignore=frozenset({id(raw_buffers)})))


def test_a_bounded_deque_filling_up_is_no_culprit_and_an_unbounded_one_is() -> None:
    import collections

    recent_losses: collections.deque[bytes] = collections.deque((b"x" * 1000 for _ in range(10)), maxlen=100)
    kept_losses: collections.deque[bytes] = collections.deque(b"x" * 1000 for _ in range(10))
    before = container_lengths()
    for i in range(30):
        recent_losses.append(bytes([i]) * 4096)
        kept_losses.append(bytes([i]) * 2048)
    grown = growing_containers(before)
    # The bounded one gained the more bytes, yet it stops at maxlen: only the unbounded one is named.
    deques = [g for g in grown if g.type_name == "deque"]
    assert [(g.items_added, g.length) for g in deques] == [(30, 40)]
    assert deques[0].holder is not None and "kept_losses" in deques[0].holder, deques[0].holder


def test_the_container_is_named_not_the_loop_variable_that_also_holds_its_newest_item() -> None:
    """``sample = decode(...); kept_samples.append(sample)``: the newest item is held by the loop's
    variable too, one hop away; the holder search starts from an older one, held by the list alone."""
    kept_samples: list[bytes] = [b"x" * 1000 for _ in range(10)]
    before = container_lengths()
    for i in range(20):
        sample = bytes([i]) * 4096
        kept_samples.append(sample)
    top = growing_containers(before)[0]
    assert top.holder is not None and top.holder.startswith("`kept_samples`"), top.holder
    assert sample is kept_samples[-1]


def test_graph_that_gains_nodes_behind_one_tensor() -> None:
    w = torch.randn(4, requires_grad=True)
    running_total = (w * 2).sum()
    before = largest_graph_nodes()
    for _ in range(30):
        running_total = running_total + (w * 3).sum()  # total += loss, without .item()
    graph = growing_graph(before, min_added=30)
    assert graph is not None
    assert graph.description == "float32[] with grad_fn"
    assert graph.nodes_added >= 60  # an add and a sum (and a mul) per iteration
    assert graph.holder is not None and "running_total" in graph.holder
    assert growing_graph(graph.nodes, min_added=1) is None  # nothing grew since


def test_containers_of_tensors_are_left_out_when_a_tensor_finding_explains_them() -> None:
    # Host RSS grown past what a CPU tensor finding explains is not those tensors: the list of kept
    # losses, which grew too, was named as the holder of a numpy cache's 40 KiB a step.
    kept_losses = [torch.zeros(()) for _ in range(10)]
    before = container_lengths()
    kept_losses.extend(torch.zeros(()) for _ in range(20))
    assert any(g.item_type == "Tensor" for g in growing_containers(before))
    explained = run_to_end(growing_containers_stepwise(before, holder_budget_s=0.5, tensors_explained=True))
    assert all(g.item_type != "Tensor" for g in explained), explained
