"""Per-step overhead of the framework integrations on the CPU test models (tests/integration/test_frameworks.py).

Usage: python benchmarks/bench_integrations.py [--steps 200] [--rounds 3] [--only lightning|transformers]

For each framework, rounds alternate: a run without gpumemd, a run with ``GpumemdCallback`` and the
agent's defaults (census at its 1% budget, leak detection), and a run with the census off. Step time
is measured inside the framework (a timing callback placed after ours: the time between consecutive
optimizer-step ends), so model setup and the framework's own start-up are left out. Prints a
markdown table: median step time and its difference from "off" (noisy on a shared machine), the
time spent inside gpumemd's callback hooks per step (timed directly: the integration's cost on the
training thread, agent step included; means, so occasional censuses count), and the agent's own
measure of its training-thread time per step. One intra-op thread, as in the tests.
"""

from __future__ import annotations

import argparse
import itertools
import logging
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch

import gpumemd

AgentOptions = dict[str, Any] | None
Hooks = tuple[float, float] | None  # (per step in step hooks, one-time attach)
AgentCost = tuple[float, int, float]  # (agent's own s/step, censuses, census seconds)
Run = Callable[[int, AgentOptions], tuple[list[float], AgentCost | None, Hooks]]

_HOOKS = ("on_fit_start", "on_train_start", "on_train_batch_end", "on_validation_start", "on_validation_end",
          "teardown", "on_train_begin", "on_step_end", "on_prediction_step", "on_evaluate", "on_train_end")


_ATTACH_HOOKS = ("on_fit_start", "on_train_begin")  # one-time: attach, components start


def timed(callback: Any, spent: list[float]) -> Any:
    """Wrap the callback's hooks (on the instance: both frameworks look hooks up with getattr) so
    the time spent inside gpumemd's callback, agent step included, is added to ``spent[0]``, and
    the one-time attach hooks to ``spent[1]``."""
    for name in _HOOKS:
        method = getattr(callback, name, None)
        if method is None:
            continue

        def wrapper(*args: Any, _method: Any = method, _slot: int = int(name in _ATTACH_HOOKS),
                    **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return _method(*args, **kwargs)
            finally:
                spent[_slot] += time.perf_counter() - t0

        setattr(callback, name, wrapper)
    return callback


def _agent_cost(agent: Any) -> AgentCost:
    state = agent.state()
    return state.overhead.seconds_per_step, state.censuses_total, state.overhead.census_seconds_total


def _medians(times: list[float]) -> float:
    return statistics.median(times[5:] if len(times) > 10 else times)  # skip the first steps' warm-up


def lightning_run(steps: int, options: AgentOptions) -> tuple[list[float], AgentCost | None, Hooks]:
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, TensorDataset

    from gpumemd.integrations.lightning import GpumemdCallback

    class Classifier(pl.LightningModule):  # type: ignore[misc,name-defined]
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return torch.nn.functional.cross_entropy(self.net(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.05)

    ends: list[float] = []
    agent_cost: list[AgentCost] = []

    class Timer(pl.Callback):  # type: ignore[misc,name-defined]
        def on_train_batch_end(self, *args: Any) -> None:
            ends.append(time.perf_counter())

        def on_train_end(self, trainer: Any, pl_module: Any) -> None:
            agent = gpumemd.current()
            if agent is not None:
                agent_cost.append(_agent_cost(agent))

    callbacks: list[Any] = [Timer()]
    spent = [0.0, 0.0]
    if options is not None:
        callbacks.insert(0, timed(GpumemdCallback(output_dir=tempfile.mkdtemp(prefix="gpumemd-bench-"),
                                                  **options), spent))
    data = TensorDataset(torch.randn(512, 32), torch.randint(0, 4, (512,)))
    trainer = pl.Trainer(max_steps=steps, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks,
                         limit_val_batches=0, default_root_dir=tempfile.mkdtemp(prefix="gpumemd-bench-pl-"))
    trainer.fit(Classifier(), DataLoader(data, batch_size=8))
    return ([b - a for a, b in itertools.pairwise(ends)], (agent_cost[0] if agent_cost else None),
            (spent[0] / steps, spent[1]) if options is not None else None)


def transformers_run(steps: int, options: AgentOptions) -> tuple[list[float], AgentCost | None, Hooks]:
    import transformers

    from gpumemd.integrations.transformers import GpumemdCallback

    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=1, n_embd=16, n_head=2, vocab_size=64, n_positions=16, bos_token_id=0, eos_token_id=0))

    class Tokens(torch.utils.data.Dataset):  # type: ignore[type-arg]
        def __len__(self) -> int:
            return 4096

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            ids = torch.randint(0, 64, (16,), generator=torch.Generator().manual_seed(i))
            return {"input_ids": ids, "labels": ids}

    ends: list[float] = []

    class Timer(transformers.TrainerCallback):  # type: ignore[misc,name-defined]
        def on_step_end(self, *args: Any, **kwargs: Any) -> None:
            ends.append(time.perf_counter())

    callbacks: list[Any] = [Timer()]
    gpumemd_cb = None
    spent = [0.0, 0.0]
    if options is not None:
        gpumemd_cb = GpumemdCallback(output_dir=tempfile.mkdtemp(prefix="gpumemd-bench-"), **options)
        callbacks.insert(0, timed(gpumemd_cb, spent))
    args = transformers.TrainingArguments(
        output_dir=tempfile.mkdtemp(prefix="gpumemd-bench-hf-"), max_steps=steps, per_device_train_batch_size=4,
        report_to=[], save_strategy="no", logging_strategy="no", use_cpu=True, disable_tqdm=True,
        dataloader_num_workers=0,
    )
    transformers.Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=callbacks).train()
    cost: AgentCost | None = None
    if gpumemd_cb is not None and gpumemd_cb.agent is not None:
        cost = _agent_cost(gpumemd_cb.agent)
    gpumemd.detach()
    in_hooks = (spent[0] / steps, spent[1]) if options is not None else None
    return [b - a for a, b in itertools.pairwise(ends)], cost, in_hooks


RUNS: dict[str, Run] = {"lightning": lightning_run, "transformers": transformers_run}
CONFIGS: dict[str, AgentOptions] = {
    "off": None,
    "defaults": {},
    "census off": {"census": False},
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--only", choices=sorted(RUNS), default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    for name in ("lightning", "lightning.pytorch", "transformers", "accelerate"):
        logging.getLogger(name).setLevel(logging.ERROR)
    print(f"torch {torch.__version__}, {args.steps} steps x {args.rounds} rounds, 1 thread\n")
    print("| framework | gpumemd | median step (µs) | Δ median vs off (µs) | in gpumemd's step hooks (µs/step) "
          "| agent's own (µs/step) | attach hook (ms, once) | censuses (all rounds) | ms per census |")
    print("|---|---|---|---|---|---|---|---|---|")
    for framework, run in RUNS.items():
        if args.only and framework != args.only:
            continue
        times: dict[str, list[float]] = {k: [] for k in CONFIGS}
        own: dict[str, list[float]] = {k: [] for k in CONFIGS}
        hooks: dict[str, list[float]] = {k: [] for k in CONFIGS}
        attach: dict[str, list[float]] = {k: [] for k in CONFIGS}
        censuses: dict[str, list[int]] = {k: [] for k in CONFIGS}
        per_census: dict[str, list[float]] = {k: [] for k in CONFIGS}
        run(20, None)  # warm the framework's imports and caches before anything is timed
        for _ in range(args.rounds):
            for label, options in CONFIGS.items():
                step_times, cost, in_hooks = run(args.steps, options)
                times[label].append(_medians(step_times))
                if cost is not None:
                    own[label].append(cost[0])
                    censuses[label].append(cost[1])
                    if cost[1]:
                        per_census[label].append(cost[2] / cost[1])
                if in_hooks is not None:
                    hooks[label].append(in_hooks[0])
                    attach[label].append(in_hooks[1])
        base = statistics.median(times["off"])

        def us(values: list[float]) -> str:
            return f"{statistics.median(values) * 1e6:.0f}" if values else "-"

        def ms(values: list[float]) -> str:
            return f"{statistics.median(values) * 1e3:.0f}" if values else "-"

        for label in CONFIGS:
            med = statistics.median(times[label])
            print(f"| {framework} | {label} | {med * 1e6:.0f} | {(med - base) * 1e6:+.0f} | {us(hooks[label])} "
                  f"| {us(own[label])} | {ms(attach[label])} | {sum(censuses[label])} | {ms(per_census[label])} |")

if __name__ == "__main__":
    main()
