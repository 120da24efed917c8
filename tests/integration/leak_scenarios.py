"""Real CPU training loops that leak (or don't), shared by the scenario tests and benchmarks/bench_leak.py.

Each scenario is a small, real PyTorch job: a 2-layer MLP on random data, SGD or Adam, 2,000 to
4,000 steps, under ``gpumemd.attach()`` at its DEFAULT settings (only ``output_dir`` is set): what a
user gets. The leaking ones start leaking at ``ONSET`` (or later, for late-onset patterns), at
realistic sizes from 2 KiB to 256 KiB per step, so the latency from onset to each state is measured.
"""

from __future__ import annotations

import collections
import contextlib
import gc
import io
import json
import logging
import os
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

import gpumemd
from gpumemd.components.leak import LeakComponent

STEPS = 2_000  # healthy jobs
LEAK_STEPS = 3_000  # leaking jobs stop earlier, once the leak is confirmed
ONSET = 300
LATE_ONSET = 800
OFF_GRID_ONSET = 327  # a graph chain that starts between two scans (the agent's are 50 steps apart here)
SETTINGS: dict[str, Any] = {}  # the defaults: the product is what attach() does with no options
SUSPECT_WITHIN = 1_500  # steps from onset to "suspected" (the README states these)
SUSPECT_WITHIN_LARGE = 500  # ... for leaks of >= 64 KiB/step (measured 450-500 at defaults)


_STOP = [False]  # set once the leak is confirmed: the rest of a leaking run would add nothing


def _steps(n: int) -> Iterator[int]:
    for step in range(n):
        if _STOP[0]:
            return
        yield step


def _model(width: int = 128) -> torch.nn.Sequential:
    return torch.nn.Sequential(torch.nn.Linear(16, width), torch.nn.ReLU(), torch.nn.Linear(width, width))


def fast_loop() -> Callable[[], torch.Tensor]:
    """One step of the fastest job there is (a linear classifier of width 8, SGD, batch 8): where the
    budget spaces the agent's work furthest. Returns the step's loss, detached."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 10)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, y = torch.randn(8, 8), torch.randint(0, 10, (8,))

    def step() -> torch.Tensor:
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def _train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, batch: int = 32) -> torch.Tensor:
    x = torch.randn(batch, 16)
    out = model(x)
    loss = out.pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    return out


# --- leaks -----------------------------------------------------------------------------------------


def loss_accumulated_with_graph(steps: int) -> None:
    """A monitoring loss summed without .item() and never backwarded: every graph stays alive."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    xv, yv = torch.randn(32, 16), torch.randn(32, 128)
    monitor_total: Any = 0.0
    for step in _steps(steps):
        _train_step(model, opt)
        if step >= ONSET:
            monitor_total += F.mse_loss(model(xv), yv)
    del monitor_total


def epoch_loss_summed_after_backward(steps: int) -> None:
    """The PyTorch FAQ pattern: ``epoch_loss += loss`` after backward (in place on one tensor from the
    second step on). Backward freed the saved tensors; every step's graph nodes stay chained to
    ``epoch_loss`` (a few hundred bytes/step). From ``OFF_GRID_ONSET``: its onset is dated to its first
    link, not to the scan that first saw it."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    epoch_loss: Any = 0.0
    for step in _steps(steps):
        x = torch.randn(32, 16)
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step >= OFF_GRID_ONSET:
            epoch_loss += loss
    del epoch_loss


class LossTracker:
    """A smoothed loss for the progress bar, kept as a tensor (no .item()): an EMA of graphs."""

    def __init__(self) -> None:
        self.ema: Any = None

    def update(self, loss: torch.Tensor) -> None:
        self.ema = loss if self.ema is None else 0.98 * self.ema + 0.02 * loss


def ema_tensor_attribute(steps: int) -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    tracker = LossTracker()
    for step in _steps(steps):
        loss = model(torch.randn(32, 16)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step >= ONSET:
            tracker.update(loss)
    tracker.ema = None


def outputs_appended_to_list(steps: int) -> None:
    """A few rows of each batch's outputs kept for later analysis: 2 KiB per step."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    kept_outputs = []
    for step in _steps(steps):
        out = _train_step(model, opt)
        if step >= ONSET:
            kept_outputs.append(out[:4].detach().clone())
    kept_outputs.clear()


def sliced_outputs_kept(steps: int) -> None:
    """Rows of each batch's outputs kept as a *view* (no ``.clone()``): the slice keeps its whole base
    alive, one storage per step, which must be one leak named by the list, not also "the base"."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    kept_slices = []
    for step in _steps(steps):
        out = _train_step(model, opt)
        if step >= ONSET:
            kept_slices.append(out.detach()[:4])
    kept_slices.clear()


class ActivationRecorder:
    """A forward hook that stores every activation (debugging code left in)."""

    def __init__(self) -> None:
        self.activations: list[torch.Tensor] = []
        self.enabled = False

    def __call__(self, module: Any, inputs: Any, output: torch.Tensor) -> None:
        if self.enabled:
            self.activations.append(output.detach())


def forward_hook_storing_activations(steps: int) -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    recorder = ActivationRecorder()
    handle = model[1].register_forward_hook(recorder)
    try:
        for step in _steps(steps):
            recorder.enabled = step >= ONSET
            _train_step(model, opt)
    finally:
        handle.remove()
        recorder.activations.clear()


def dict_cache_keyed_by_sample_id(steps: int) -> None:
    """Predictions cached per sample id, switched on late (step ``LATE_ONSET``): ids never repeat."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    prediction_cache: dict[int, torch.Tensor] = {}
    for step in _steps(steps):
        out = _train_step(model, opt)
        if step >= LATE_ONSET:
            prediction_cache[step * 32] = out[0].detach().clone()
    prediction_cache.clear()


class Node:
    """An object in a reference cycle (it points to itself) that owns a tensor."""

    def __init__(self, payload: torch.Tensor) -> None:
        self.payload = payload
        self.me = self


def reference_cycles_with_gc_disabled(steps: int) -> None:
    """gc disabled for speed (as some jobs do): tensors in reference cycles are never freed."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        for step in _steps(steps):
            out = _train_step(model, opt)
            if step >= ONSET:
                Node(out.detach().clone())
    finally:
        if was_enabled:
            gc.enable()
        gc.collect()


def retain_graph_misuse(steps: int) -> None:
    """backward(retain_graph=True) "to be safe", and the loss kept for a plot: every step's graph,
    saved activations included, stays alive (without retain_graph, backward would have freed them)."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loss_history = []
    for step in _steps(steps):
        out = model(torch.randn(32, 16))
        loss = out.pow(2).mean()
        opt.zero_grad()
        loss.backward(retain_graph=True)
        opt.step()
        if step >= ONSET:
            loss_history.append(loss)
    loss_history.clear()


SECOND_ONSET = 1_300  # host_cache_beside_kept_losses: the cache's first step


def host_cache_beside_kept_losses(steps: int) -> None:
    """Every step's loss kept as a tensor (4 B/step, from step 0) and, from ``SECOND_ONSET``, a numpy
    copy of the step's output kept in a dict (64 KiB/step): a host leak that starts while a CPU tensor
    leak is tracked (``test_leak_host_growth``). The dict holds only untracked objects (ints, numpy
    arrays), so gc does not track it and no heap look sees it."""
    import numpy as np

    step_once = fast_loop()
    losses = []
    cache = {}
    for step in _steps(steps):
        losses.append(step_once())
        if step >= SECOND_ONSET:
            cache[step] = np.ones(8192)


AFTER_DEQUE_ONSET = 1_100  # host_leak_after_a_full_deque: the first raw sample kept


def host_leak_after_a_full_deque(steps: int) -> None:
    """The last 1,000 losses kept with their graphs (full at step 1,000: a healthy job's growth, withheld)
    and, from ``AFTER_DEQUE_ONSET``, raw sample buffers (64 KiB/step) kept in a list: a host leak that
    starts once the deque's growth has stopped (``test_leak_host_growth``)."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    recent_losses: collections.deque[torch.Tensor] = collections.deque(maxlen=1_000)
    raw_samples: list[bytes] = []
    for step in _steps(steps):
        recent_losses.append(_step_keeping_its_graph(model, opt))
        if step >= AFTER_DEQUE_ONSET:
            raw_samples.append(bytes([step % 256]) * (64 * 1024))


def predictions_carrying_host_buffers(steps: int) -> None:
    """Predictions kept with the raw sample each came from attached (an attribute on the tensor): 128 B
    of tensor a step, 64 KiB of host memory. Host RSS, not the tensors' bytes, is what runs out: the
    finding names the tensors' holder and states (and projects from) the host growth. The same gap
    comes from the heap alone: small CPU tensors kept each step pin freed heap the allocator cannot
    give back (256 B/step of tensors grew a plain MLP loop's RSS by ~30 KiB/step)."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    kept_predictions = []
    for step in _steps(steps):
        out = _train_step(model, opt)
        if step >= ONSET:
            prediction = out[:, :2].argmax(1).float()
            prediction.raw_sample = bytes([step % 256]) * (64 * 1024)  # type: ignore[attr-defined]
            kept_predictions.append(prediction)
    kept_predictions.clear()


def host_only_leak(steps: int) -> None:
    """Raw sample buffers (bytes, not tensors) kept in a list: only host RSS grows."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    raw_samples: list[bytes] = []
    for step in _steps(steps):
        _train_step(model, opt)
        if step >= ONSET:
            raw_samples.append(bytes([step % 256]) * (128 * 1024))
    raw_samples.clear()


def _logits_model() -> torch.nn.Sequential:
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))


def _logits_step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> torch.Tensor:
    out = model(torch.randn(64, 16))
    loss = out.pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    return out


def logits_concatenated_every_step(steps: int) -> None:
    """An eval-style accumulation, ``all_logits = torch.cat([all_logits, out.detach()])``: one tensor
    alive at any time, a new one each step, 64 rows (2.5 KiB) larger than the last."""
    model = _logits_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    all_logits = torch.empty(0, 10)
    for step in _steps(steps):
        out = _logits_step(model, opt)
        if step >= ONSET:
            all_logits = torch.cat([all_logits, out.detach()])
    del all_logits


class DecodedSampleCache(torch.utils.data.Dataset[list[float]]):
    """A Dataset that keeps every decoded sample (8 KiB) in a dict, in whichever worker decoded it;
    ``size`` samples, each worker caching its share (never evicted), from sample ``cache_from`` on."""

    def __init__(self, size: int, cache_from: int = 0) -> None:
        self.size = size
        self.cache_from = cache_from
        self.decoded: dict[int, torch.Tensor] = {}

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> list[float]:
        sample = self.decoded.get(i)
        if sample is None:
            sample = torch.full((2048,), float(i))  # "decoded": written, so resident
            if i >= self.cache_from:
                self.decoded[i] = sample
        return sample[:4].tolist()


def _loader(dataset: torch.utils.data.Dataset[list[float]], *, persistent: bool) -> Any:
    # Batches as plain lists (through the workers' pipe, not a shared-memory tensor each): the
    # scenario's steps stay short; the memory that matters is the workers' own.
    return torch.utils.data.DataLoader(dataset, batch_size=16, num_workers=2, persistent_workers=persistent,
                                       multiprocessing_context="fork", collate_fn=list)


def _loader_steps(loader: Any, steps: int) -> None:
    """Train a tiny model on ``loader``'s batches for ``steps`` steps, epoch after epoch."""
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    batches = iter(())
    for _ in _steps(steps):
        batch = next(batches, None)
        if batch is None:
            batches = iter(loader)  # a new epoch (non-persistent workers start again)
            batch = next(batches)
        loss = model(torch.tensor(batch)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    del batches


def dataloader_worker_cache(steps: int) -> None:
    """Persistent DataLoader workers whose Dataset caches every decoded sample once caching is
    switched on (step ``ONSET``, 16 samples a step): each worker grows ~64 KiB/step while the
    training process stays flat."""
    _loader_steps(_loader(DecodedSampleCache(10**7, cache_from=ONSET * 16), persistent=True), steps)


# --- healthy jobs ----------------------------------------------------------------------------------


def steady(steps: int) -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    for _ in _steps(steps):
        _train_step(model, opt)


def first_step_optimizer_state(steps: int) -> None:
    """Adam allocates exp_avg/exp_avg_sq on its first step: a one-time jump at step 0-1."""
    model = _model(256)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for _ in _steps(steps):
        _train_step(model, opt)


def periodic_eval_under_no_grad(steps: int) -> None:
    """Every 40 steps, 8 eval batches (4x larger, outputs kept for the eval metric) under no_grad,
    each ended with mark_step inside gpumemd.phase("eval")."""
    agent = gpumemd.current()
    assert agent is not None
    agent.use_manual_steps()  # this job ends its steps with mark_step, train and eval alike
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in _steps(steps):
        _train_step(model, opt)
        gpumemd.mark_step()
        if step % 40 == 39:
            eval_outputs = []
            with gpumemd.phase("eval"), torch.no_grad():
                for _ in range(8):
                    eval_outputs.append(model(torch.randn(128, 16)))
                    gpumemd.mark_step()
            del eval_outputs


def variable_batch_and_sequence_lengths(steps: int) -> None:
    rng = random.Random(torch.initial_seed())
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in _steps(steps):
        b, t = rng.randint(4, 48), rng.randint(2, 24)
        out = model(torch.randn(b, t, 16))
        loss = out.pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


class ShapeCache:
    """Attention-mask style cache keyed by shape: bounded by the number of distinct shapes."""

    def __init__(self) -> None:
        self.masks: dict[tuple[int, int], torch.Tensor] = {}

    def get(self, b: int, t: int) -> torch.Tensor:
        if (b, t) not in self.masks:
            self.masks[(b, t)] = torch.ones(b, t, 16)
        return self.masks[(b, t)]


def bounded_cache_keyed_by_shape(steps: int) -> None:
    rng = random.Random(torch.initial_seed() + 1)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    cache = ShapeCache()
    for _ in _steps(steps):
        b, t = rng.choice((16, 32)), rng.choice((8, 16, 32))
        out = model(torch.randn(b, t, 16) * cache.get(b, t))
        loss = out.pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


def recent_outputs_in_a_bounded_deque(steps: int) -> None:
    """The leak "list of outputs" with a bound: the last 1,000 steps' rows kept for a rolling metric in a
    ``deque(maxlen=1000)``. The count grows for 1,000 steps, then stays."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    recent_outputs: collections.deque[torch.Tensor] = collections.deque(maxlen=1_000)
    for _ in _steps(steps):
        recent_outputs.append(_train_step(model, opt)[:4].detach().clone())


def recent_rows_in_a_bounded_deque_four_an_item(steps: int) -> None:
    """The same bound, each item a tuple of the step's first four output rows: the group's count grows
    four a step while the deque fills one item a step, for 1,000 steps, then stays."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    recent_rows: collections.deque[tuple[torch.Tensor, ...]] = collections.deque(maxlen=1_000)
    for _ in _steps(steps):
        out = _train_step(model, opt)
        recent_rows.append(tuple(out[i].detach().clone() for i in range(4)))


def recent_losses_with_graphs_in_a_bounded_deque(steps: int) -> None:
    """The last 1,000 losses kept with their graphs (``retain_graph=True``): the graphs' saved tensors
    grow and settle with the deque."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    recent_losses: collections.deque[torch.Tensor] = collections.deque(maxlen=1_000)
    for _ in _steps(steps):
        recent_losses.append(_step_keeping_its_graph(model, opt))


def _step_keeping_its_graph(model: torch.nn.Module, opt: torch.optim.Optimizer) -> torch.Tensor:
    """One step whose loss keeps its graph (``retain_graph=True``): returned for the caller to keep."""
    loss = model(torch.randn(32, 16)).pow(2).mean()
    opt.zero_grad()
    loss.backward(retain_graph=True)
    opt.step()
    return loss


def metric_list_reset_every_epoch(steps: int) -> None:
    """Predictions gathered for an epoch-level metric (AUROC-style), reset every 200-step epoch: as a
    list, and as one tensor concatenated onto each step (``torch.cat``, a larger copy every step); and
    a running tensor replaced each step by one of the same size."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    epoch_predictions: list[torch.Tensor] = []
    all_logits = torch.empty(0, 16)
    smoothed = torch.zeros(32, 128)
    for step in _steps(steps):
        out = _train_step(model, opt)
        epoch_predictions.append(out.detach().clone())
        all_logits = torch.cat([all_logits, out.detach()[:, :16].clone()])
        smoothed = 0.9 * smoothed + 0.1 * out.detach()
        if step % 200 == 199:
            torch.cat(epoch_predictions).mean()  # "compute" the metric
            all_logits.softmax(-1).mean()
            epoch_predictions = []
            all_logits = torch.empty(0, 16)


def dataloader_persistent_workers_warm(steps: int) -> None:
    """Persistent workers that cache a small dataset whole in their first epoch, then stay flat."""
    _loader_steps(_loader(DecodedSampleCache(512), persistent=True), steps)


def dataloader_workers_restarted_each_epoch(steps: int) -> None:
    """Workers started again every 100-step epoch (no persistent_workers), each caching its share of
    the epoch's samples: every epoch's workers grow, then exit."""
    _loader_steps(_loader(DecodedSampleCache(1_600), persistent=False), steps)


def gradient_accumulation(steps: int) -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in _steps(steps):
        opt.zero_grad()
        for _ in range(4):
            loss = model(torch.randn(8, 16)).pow(2).mean() / 4
            loss.backward()
        opt.step()


def micro_batch_losses_summed(steps: int) -> None:
    """Micro-batch losses summed as tensors and backwarded once per step: a graph chain, within a step."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in _steps(steps):
        total: Any = 0.0
        for _ in range(4):
            total = total + model(torch.randn(8, 16)).pow(2).mean() / 4
        opt.zero_grad()
        total.backward()
        opt.step()


def epoch_loss_as_item(steps: int) -> None:
    """The FAQ's fix: ``epoch_loss += loss.item()``, and a tensor running loss detached each step."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    epoch_loss = 0.0
    running = torch.zeros(())
    for step in _steps(steps):
        loss = model(torch.randn(32, 16)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        epoch_loss += loss.item()
        running = 0.98 * running + 0.02 * loss.detach()
        if step % 200 == 199:
            epoch_loss = 0.0


def cyclic_garbage_freed_in_bursts(steps: int) -> None:
    """Each step leaves a tensor in a reference cycle (garbage at once); a raised gc threshold, as
    some jobs set for speed, frees it in bursts when a collection finally runs."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    old = gc.get_threshold()
    gc.set_threshold(5_000, *old[1:])
    try:
        for _ in _steps(steps):
            out = _train_step(model, opt)
            Node(out[:4].detach().clone())
    finally:
        gc.set_threshold(*old)


def one_time_jump_checkpoint_load(steps: int) -> None:
    """At step 900 a checkpoint (an extra 2 MiB of tensors) is loaded and kept."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    buf = io.BytesIO()
    torch.save({"ema": [torch.randn(256, 256) for _ in range(8)]}, buf)
    checkpoint = None
    for step in _steps(steps):
        _train_step(model, opt)
        if step == 900:
            buf.seek(0)
            checkpoint = torch.load(buf)
    del checkpoint


# --- the registry ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Scenario:
    name: str
    run: Callable[[int], None]
    kind: str | None = None  # expected finding kind (None: healthy, nothing may fire)
    holder: tuple[str, ...] = ()  # substrings the summary must contain (the holder)
    settings: dict[str, Any] = field(default_factory=dict)
    onset: int = ONSET
    bytes_per_step: int = 0  # the leak's size (decides the latency it must be found within)
    rate: str = ""  # what the summary must say per step, e.g. "+1 tensor/step" when one leaks per step

    @property
    def leak(self) -> bool:
        return self.kind is not None


LEAKS = (
    Scenario("loss accumulated with its graph", loss_accumulated_with_graph, "graph_leak",
             ("`monitor_total` in loss_accumulated_with_graph()",), bytes_per_step=16 * 1024),
    Scenario("epoch_loss += loss after backward (FAQ)", epoch_loss_summed_after_backward, "graph_leak",
             ("`epoch_loss` in epoch_loss_summed_after_backward()",), onset=OFF_GRID_ONSET,
             rate="+1 autograd node/step"),
    Scenario("EMA of the loss kept as a tensor attribute", ema_tensor_attribute, "graph_leak",
             ("`tracker.ema` in ema_tensor_attribute()",), rate="+2 autograd nodes/step"),
    Scenario("list of outputs (2 KiB/step)", outputs_appended_to_list, "tensor_leak",
             ("`kept_outputs` in outputs_appended_to_list()",), bytes_per_step=2048, rate="+1 tensor/step"),
    Scenario("sliced outputs kept as views (base kept alive)", sliced_outputs_kept, "tensor_leak",
             ("`kept_slices` in sliced_outputs_kept()",), bytes_per_step=16 * 1024, rate="+1 tensor/step"),
    Scenario("forward hook storing activations", forward_hook_storing_activations, "tensor_leak",
             ("`recorder.activations` in forward_hook_storing_activations()",), bytes_per_step=16 * 1024,
             rate="+1 tensor/step"),
    Scenario("dict cache keyed by sample id, late onset", dict_cache_keyed_by_sample_id, "tensor_leak",
             ("`prediction_cache` in dict_cache_keyed_by_sample_id()",), onset=LATE_ONSET, bytes_per_step=512,
             rate="+1 tensor/step"),
    Scenario("tensors kept alive by reference cycles", reference_cycles_with_gc_disabled, "tensor_leak",
             ("Node.payload",), bytes_per_step=16 * 1024, rate="+1 tensor/step"),
    Scenario("retain_graph=True misuse", retain_graph_misuse, "graph_leak",
             ("`loss_history` in retain_graph_misuse()",), bytes_per_step=16 * 1024, rate="+1 tensor/step"),
    Scenario("logits concatenated every step (torch.cat, 2.5 KiB/step)", logits_concatenated_every_step,
             "tensor_leak", ("`all_logits` in logits_concatenated_every_step()",), bytes_per_step=2560,
             rate="+64 rows/step"),
    Scenario("DataLoader workers caching decoded samples (persistent)", dataloader_worker_cache, "host_leak",
             ("DataLoader workers (2, pids", "DecodedSampleCache"), bytes_per_step=128 * 1024,
             rate="KiB/step each"),
    Scenario("host-only Python buffer (128 KiB/step)", host_only_leak, "host_leak",
             ("`raw_samples` in host_only_leak()",), bytes_per_step=128 * 1024),
)
HOST_HEAVY = Scenario("predictions kept with their raw samples (128 B/step of tensors, 64 KiB/step of host)",
                      predictions_carrying_host_buffers, "tensor_leak",
                      ("`kept_predictions` in predictions_carrying_host_buffers()",), bytes_per_step=128,
                      rate="+1 tensor/step")
"""A CPU tensor leak whose host growth is 512x its tensors' bytes (``test_leak_host_growth``)."""
SECOND_HOST = Scenario("a numpy cache filled beside kept losses (64 KiB/step of host from step 1,300)",
                       host_cache_beside_kept_losses, "host_leak", onset=SECOND_ONSET)
"""A host leak that starts while a CPU tensor leak is tracked (``test_leak_host_growth``)."""
AFTER_DEQUE = Scenario("raw samples kept from step 1,100, beside a deque of graphs full at 1,000",
                       host_leak_after_a_full_deque, "host_leak", ("`raw_samples` in host_leak_after_a_full_deque()",),
                       onset=AFTER_DEQUE_ONSET, bytes_per_step=64 * 1024)
"""A host leak that starts once a bounded deque's withheld growth has stopped (``test_leak_host_growth``)."""
HEALTHY = (
    Scenario("steady training", steady),
    Scenario("first-step optimizer state (Adam)", first_step_optimizer_state),
    Scenario("periodic eval under no_grad", periodic_eval_under_no_grad),
    Scenario("variable batch and sequence lengths", variable_batch_and_sequence_lengths),
    Scenario("bounded cache keyed by shape", bounded_cache_keyed_by_shape),
    Scenario("metric list reset every epoch", metric_list_reset_every_epoch),
    Scenario("recent outputs in a bounded deque", recent_outputs_in_a_bounded_deque),
    Scenario("recent rows in a bounded deque, four tensors an item", recent_rows_in_a_bounded_deque_four_an_item),
    Scenario("recent losses with their graphs in a bounded deque", recent_losses_with_graphs_in_a_bounded_deque),
    Scenario("DataLoader persistent workers, warm then flat", dataloader_persistent_workers_warm),
    Scenario("DataLoader workers restarted each epoch", dataloader_workers_restarted_each_epoch),
    Scenario("gradient accumulation", gradient_accumulation),
    Scenario("micro-batch losses summed, one backward", micro_batch_losses_summed),
    Scenario("epoch loss as .item(), detached running loss", epoch_loss_as_item),
    Scenario("one-time jump (checkpoint load)", one_time_jump_checkpoint_load),
    Scenario("cyclic garbage freed in bursts", cyclic_garbage_freed_in_bursts),
)


@dataclass
class Outcome:
    """What one scenario run produced."""

    events: list[dict[str, Any]]  # the findings file: one record per state change
    findings: list[Any]  # Agent.findings() at the end
    steps: int
    wall_s: float
    leak_eval_s: float  # time spent in the detector's evaluations
    leak_step_s: float  # the leak component's total on_step time (feeding + evaluations)
    scan_s: float = 0.0  # of which survivor scans (long-lived tensor counts)
    warnings: list[str] = field(default_factory=list)  # gpumemd's WARNING lines (isolated runs only)
    log: list[str] = field(default_factory=list)  # all of gpumemd's lines, INFO and up, the exit summary included

    def first(self, state: str) -> dict[str, Any] | None:
        return next((e for e in self.events if e["state"] == state), None)


class _Timed:
    """Wraps the leak component's on_step to measure its whole per-step cost (and, for leaking runs,
    to end the run once a finding of the leak's kind, ``stop_at``, is confirmed)."""

    def __init__(self, agent: Any, component: Any, stop_at: str | None) -> None:
        self.agent = agent
        self.seconds = 0.0
        self._inner = component.on_step
        self._stop = stop_at

    def __call__(self, record: Any) -> None:
        start = time.perf_counter()
        try:
            self._inner(record)
        finally:
            self.seconds += time.perf_counter() - start
        if self._stop and any(f.state == "confirmed" and f.kind == self._stop for f in self.agent.state().findings):
            _STOP[0] = True


def run_scenario(scenario: Scenario, output_dir: str, steps: int | None = None, *, stop_when_confirmed: bool = True,
                 seed: int = 0) -> Outcome:
    """Run one scenario under a fresh agent at default settings; a leaking one stops once its leak is
    confirmed."""
    steps = steps if steps is not None else (LEAK_STEPS if scenario.leak else STEPS)
    torch.manual_seed(seed)
    torch.set_num_threads(1)  # tiny tensors: intra-op threads only contend on a shared machine
    _STOP[0] = False
    start = time.perf_counter()
    with gpumemd.attached(output_dir=output_dir, **{**SETTINGS, **scenario.settings}) as agent:
        component = agent.component(LeakComponent)
        assert component is not None, "the leak component is not registered"
        timed = _Timed(agent, component, scenario.kind if stop_when_confirmed else None)
        component.on_step = timed  # type: ignore[method-assign]
        try:
            scenario.run(steps)
        finally:
            _STOP[0] = False
        findings = agent.findings()
        path = component.findings_path  # type: ignore[attr-defined]
        eval_s = component.evaluate_seconds  # type: ignore[attr-defined]
        scan_s = component.scan_seconds  # type: ignore[attr-defined]
        recorded = agent.state().steps_total
    events = []
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            events = [json.loads(line) for line in f]
    return Outcome(events, findings, recorded, time.perf_counter() - start, eval_s, timed.seconds, scan_s)


def run_scenario_isolated(scenario: Scenario, output_dir: str, *, seed: int = 0,
                          stop_when_confirmed: bool = True) -> Outcome:
    """``run_scenario`` in a fresh interpreter: host-RSS scenarios measure the process's memory, which a
    test session's earlier tests have grown and fragmented (freed heap absorbs the first megabytes of
    a leak). Findings come back as namespaces with the ``Finding`` fields; WARNING lines in ``warnings``."""
    import subprocess
    import sys
    from types import SimpleNamespace

    result_path = os.path.join(output_dir, "outcome.json")
    code = (
        "import dataclasses, json, sys\n"
        f"sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r})\n"
        "import leak_scenarios as ls\n"
        "with ls.warnings_collected() as lines, ls.log_collected() as log:\n"
        f"    o = ls.run_scenario(ls.scenario_named({scenario.name!r}), {output_dir!r}, seed={seed},\n"
        f"                        stop_when_confirmed={stop_when_confirmed})\n"
        "out = dict(events=o.events, findings=[dataclasses.asdict(f) for f in o.findings], steps=o.steps,\n"
        "           wall_s=o.wall_s, leak_eval_s=o.leak_eval_s, leak_step_s=o.leak_step_s, scan_s=o.scan_s,\n"
        "           warnings=lines, log=log)\n"
        f"json.dump(out, open({result_path!r}, 'w'))\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=600)
    with open(result_path, encoding="utf-8") as f:
        data = json.load(f)
    os.remove(result_path)
    data["findings"] = [SimpleNamespace(**f) for f in data["findings"]]
    return Outcome(**data)


def scenario_named(name: str) -> Scenario:
    return next(s for s in (*LEAKS, *HEALTHY, HOST_HEAVY, SECOND_HOST, AFTER_DEQUE) if s.name == name)


class _WarningLines(logging.Handler):
    def __init__(self, level: int = logging.WARNING, *, only: bool = True) -> None:
        super().__init__(level)
        self.lines: list[str] = []
        self._only = only

    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno == self.level or not self._only:
            self.lines.append(record.getMessage())


@contextlib.contextmanager
def warnings_collected() -> Iterator[list[str]]:
    """gpumemd's WARNING lines while the block runs, for a run whose log no test's caplog sees."""
    handler = _WarningLines()
    logger = logging.getLogger("gpumemd")
    logger.addHandler(handler)
    try:
        yield handler.lines
    finally:
        logger.removeHandler(handler)


@contextlib.contextmanager
def log_collected() -> Iterator[list[str]]:
    """All of gpumemd's lines at INFO and up while the block runs (the start line and the exit
    summary go to ``gpumemd.status`` at INFO when a handler listens): what a user reads in a log."""
    handler = _WarningLines(logging.INFO, only=False)
    logger = logging.getLogger("gpumemd")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield handler.lines
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def quiet_worker() -> None:
    """A scenario pool worker's initializer: its jobs' start and exit lines would go to the terminal
    (the test runner captures its own output, not a worker's); what the tests check comes back in
    the Outcome."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)
    os.close(devnull)


def run_in_worker(name: str, output_dir: str, seed: int) -> Outcome:
    """One scenario run in a pool worker, its WARNING lines in ``warnings``: host-RSS leaks still in a
    fresh interpreter (``run_scenario_isolated``), the others in the worker itself, as in the test
    session's own process."""
    scenario = scenario_named(name)
    if scenario.kind == "host_leak":
        return run_scenario_isolated(scenario, output_dir, seed=seed)
    with warnings_collected() as lines, log_collected() as log:
        outcome = run_scenario(scenario, output_dir, seed=seed)
    outcome.warnings = list(lines)
    outcome.log = list(log)
    return outcome
