"""GraphChainTracker: autograd graphs chained across steps, followed by sequence number."""

from __future__ import annotations

import gc
import weakref
from typing import Any

import torch

from gpumemd.probes.survival.graph_chains import GraphChainTracker


def _model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


class _Loop:
    """A training loop driven step by step; ``after_step`` runs after the optimizer step, where
    jobs accumulate their monitoring values."""

    def __init__(self, tracker: GraphChainTracker, scan_every: int = 10) -> None:
        self.model = _model()
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.01)
        self.tracker = tracker
        self.scan_every = scan_every
        self.made: list[weakref.ref[Any]] = []  # tensors made since the last scan (the roots)

    def run(self, steps: int, after_step: Any) -> list[int]:
        """Returns the chained node count of the largest group after each scan."""
        sizes = []
        for step in range(steps):
            loss = self.model(torch.randn(4, 8)).pow(2).mean()
            self.opt.zero_grad()
            loss.backward()
            self.opt.step()
            kept = after_step(loss)
            self.made.extend(weakref.ref(t) for t in (loss, kept) if t is not None)
            if (step + 1) % self.scan_every == 0:
                self.tracker.mark_step(step)
            if step % self.scan_every == 0:
                roots = [t for r in reversed(self.made) if (t := r()) is not None and t.grad_fn is not None]
                self.tracker.scan(roots, step)
                del roots
                self.made.clear()
                sizes.append(max((g.nodes for g in self.tracker.groups()), default=0))
        return sizes


def test_faq_total_plus_loss_grows_one_node_per_step() -> None:
    tracker = GraphChainTracker()
    state: dict[str, Any] = {"total": 0.0}

    def accumulate(loss: torch.Tensor) -> torch.Tensor:
        state["total"] = state["total"] + loss
        return state["total"]

    sizes = _Loop(tracker).run(301, accumulate)
    assert sizes[-1] - sizes[-11] == 100  # 10 scans, 10 steps each, one AddBackward per step
    group = tracker.groups()[0]
    assert group.describe() == "float32[] with grad_fn"
    assert tracker.sample(group.key) is state["total"]


def test_in_place_accumulator_is_followed_through_its_changing_grad_fn() -> None:
    """``total += loss``: one tensor object whose grad_fn is replaced every step."""
    tracker = GraphChainTracker()
    state: dict[str, Any] = {"total": None}

    def accumulate(loss: torch.Tensor) -> torch.Tensor:
        if state["total"] is None:
            state["total"] = loss * 1
        else:
            state["total"] += loss
        return state["total"]

    sizes = _Loop(tracker).run(301, accumulate)
    assert sizes[-1] - sizes[-11] == 100
    assert tracker.sample(tracker.groups()[0].key) is state["total"]


def test_ema_kept_as_tensor_grows_two_nodes_per_step() -> None:
    tracker = GraphChainTracker()
    state: dict[str, Any] = {"ema": None}

    def ema(loss: torch.Tensor) -> torch.Tensor:
        state["ema"] = loss if state["ema"] is None else 0.9 * state["ema"] + 0.1 * loss
        return state["ema"]

    sizes = _Loop(tracker).run(201, ema)
    assert sizes[-1] - sizes[-6] == 100  # MulBackward + AddBackward per step


def test_healthy_loop_and_item_accumulation_start_no_chain() -> None:
    tracker = GraphChainTracker()
    total = [0.0]

    def item(loss: torch.Tensor) -> None:
        total[0] += loss.item()

    sizes = _Loop(tracker).run(201, item)
    assert sizes == [0] * len(sizes)
    assert tracker.popped > 0  # the roots were searched, and found to span nothing


def test_chain_reset_every_epoch_falls_back() -> None:
    tracker = GraphChainTracker()
    state: dict[str, Any] = {"total": 0.0, "n": 0}

    def accumulate(loss: torch.Tensor) -> torch.Tensor:
        state["n"] += 1
        if state["n"] % 50 == 0:
            state["total"] = 0.0  # epoch end: the chain is dropped
        state["total"] = state["total"] + loss
        return state["total"]

    sizes = _Loop(tracker).run(401, accumulate)
    assert max(sizes) <= 50
    assert min(sizes[5:]) < 20  # it falls at each epoch


def test_cached_graph_from_init_reached_every_step_is_not_a_chain() -> None:
    """A tensor computed once with a graph (kept on the model) is reached by every step's graph:
    spanning steps, but no chain that grows."""
    tracker = GraphChainTracker()
    loop = _Loop(tracker)
    offset_param = torch.nn.Parameter(torch.zeros(4))
    offset = offset_param + 1  # a graph made before the loop (AddBackward saves nothing: reusable)
    original_forward = loop.model.forward

    def forward(x: torch.Tensor) -> torch.Tensor:
        return original_forward(x) + offset

    loop.model.forward = forward  # type: ignore[method-assign]
    sizes = loop.run(201, lambda loss: None)
    assert 1 <= max(sizes) <= 2  # seen as spanning steps (a chain of one link), never growing


def test_holds_no_strong_reference() -> None:
    tracker = GraphChainTracker()
    state: dict[str, Any] = {"total": 0.0}

    def accumulate(loss: torch.Tensor) -> torch.Tensor:
        state["total"] = state["total"] + loss
        return state["total"]

    _Loop(tracker).run(101, accumulate)
    ref = weakref.ref(state["total"])
    state["total"] = None
    gc.collect()
    assert ref() is None
    tracker.scan([])
    assert tracker.groups() == []  # the chain's root died: the chain ended


def test_a_failing_root_degrades_to_no_chains() -> None:
    class Broken:
        @property
        def grad_fn(self) -> Any:
            raise RuntimeError("odd tensor")

    tracker = GraphChainTracker()
    tracker.mark_step()
    tracker.scan([Broken()])
    assert tracker.errors == 1 and tracker.groups() == []


def test_a_new_chain_is_dated_between_the_marks_around_its_first_link() -> None:
    tracker = GraphChainTracker()
    state: dict[str, Any] = {"total": 0.0, "step": 0}

    def accumulate_from_step_125(loss: torch.Tensor) -> torch.Tensor | None:
        state["step"] += 1
        if state["step"] <= 125:
            return None
        state["total"] = state["total"] + loss
        return state["total"]

    _Loop(tracker).run(301, accumulate_from_step_125)
    [group] = tracker.groups()
    # marks after steps 119 and 129 (the ends of the steps before each scan); the first link was made
    # in loop step 125: dated between the two marks, in proportion to the nodes made since the first
    assert group.began_at is not None and 124 <= group.began_at <= 126
    # Found at the scan of step 130 as one node, it had six links then: measured at the next scan from
    # its rate (one a step) and where it began, so its count is every link made since step 125.
    assert group.found is not None and group.found[0] == 130 and 4 <= group.found[1] <= 6, group.found
    assert abs(group.nodes - (300 - 125)) <= 2, group.nodes
