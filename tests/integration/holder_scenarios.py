"""Leaks kept by containers of every kind, each in its own small CPU training loop, for the holder
path: the finding must name the variable, global or class attribute the script wrote.

Each loop trains the 2-layer MLP of ``leak_scenarios`` on random data under ``gpumemd.attached()`` at
its DEFAULT settings (only ``output_dir``), and leaks one 64 KiB tensor per step from ``ONSET`` on,
into one kind of container. A run ends at the first finding: the holder path is in its sentence,
with the line of this file that adds to the holder (``HolderScenario.adds``) where one does.

``CAUSES``: one cause that grows several groups of tensors (a tensor appended with its labels, a
kept frame's locals) must be one finding that lists them. These runs go on until the finding is
confirmed, so a group that joined the cause one evaluation late is in it too.
"""

from __future__ import annotations

import collections
import functools
import queue
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
from leak_scenarios import _model, _train_step

import gpumemd

ONSET = 60
MAX_STEPS = 1_500  # a 64 KiB/step leak is suspected ~500 steps after its onset at defaults
_LEAK_SHAPE = (128, 128)  # float32: 64 KiB per step


def _leaked(out: torch.Tensor) -> torch.Tensor:
    """A 64 KiB tensor without grad_fn made from this step's outputs."""
    return out.detach().mean() + torch.zeros(_LEAK_SHAPE)


_until = "finding"  # when a run stops: at the first finding, or at the first confirmed one ("confirmed")


class _Run:
    """The steps of one scenario: stops at the first finding (or confirmed one, see ``_until``)."""

    def __init__(self) -> None:
        self.agent = gpumemd.current()
        self.model = _model()
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.01)

    def steps(self) -> Iterator[int]:
        assert self.agent is not None
        for step in range(MAX_STEPS):
            findings = self.agent.state().findings
            if any(f.state == "confirmed" for f in findings) if _until == "confirmed" else findings:
                return
            yield step

    def train(self) -> torch.Tensor:
        return _train_step(self.model, self.opt)


# --- the scenarios: one container kind each ----------------------------------------------------


def log_metric(value: torch.Tensor) -> None:
    """A deferred logging call (run at the end of the epoch, never)."""


def partial_callbacks() -> None:
    run = _Run()
    callbacks = []
    for step in run.steps():
        out = run.train()
        if step >= ONSET:
            callbacks.append(functools.partial(log_metric, _leaked(out)))


def _make_report(value: torch.Tensor) -> Callable[[], float]:
    return lambda: float(value.sum())


def closures_in_a_list() -> None:
    run = _Run()
    reports = []
    for step in run.steps():
        out = run.train()
        if step >= ONSET:
            reports.append(_make_report(_leaked(out)))


def queue_never_drained() -> None:
    run = _Run()
    pending: queue.Queue[torch.Tensor] = queue.Queue()
    for step in run.steps():
        out = run.train()
        if step >= ONSET:
            pending.put(_leaked(out))


class Stats:
    def __init__(self) -> None:
        self.window: collections.deque[torch.Tensor] = collections.deque()  # no maxlen


class Trainer:
    def __init__(self) -> None:
        self.stats = Stats()


def deque_in_nested_attributes() -> None:
    run = _Run()
    trainer = Trainer()
    for step in run.steps():
        out = run.train()
        if step >= ONSET:
            trainer.stats.window.append(_leaked(out))


class SlotCache:
    __slots__ = ("entries",)

    def __init__(self) -> None:
        self.entries: collections.OrderedDict[int, torch.Tensor] = collections.OrderedDict()


def ordered_dict_in_slots() -> None:
    run = _Run()
    cache = SlotCache()
    for step in run.steps():
        out = run.train()
        if step >= ONSET:
            cache.entries[step] = _leaked(out)


def _failing_step(out: torch.Tensor) -> None:
    act = _leaked(out)
    raise RuntimeError(f"non-finite activations ({act.shape})")


def exceptions_kept_with_their_frames() -> None:
    run = _Run()
    errors = []
    for step in run.steps():
        out = run.train()
        if step >= ONSET:
            try:
                _failing_step(out)
            except RuntimeError as exc:
                errors.append(exc)  # "for the report": keeps the frame, and its locals


def numpy_arrays_sharing_storage() -> None:
    run = _Run()
    epoch_arrays = []
    for step in run.steps():
        out = run.train()
        if step >= ONSET:
            epoch_arrays.append(_leaked(out).numpy())  # shares the tensor's storage: keeps it


def _attach_probe(model: torch.nn.Module) -> None:
    acts: list[torch.Tensor] = []
    model[1].register_forward_hook(lambda module, inputs, output: acts.append(_leaked(output)))


def forward_hook_closure() -> None:
    run = _Run()
    model = run.model
    for step in run.steps():
        if step == ONSET:
            _attach_probe(model)
        run.train()


CAPTURED: list[torch.Tensor] = []


def _keep_output(module: torch.nn.Module, inputs: Any, output: torch.Tensor) -> None:
    CAPTURED.append(_leaked(output))  # "for the activation histogram": a hook keeps every step's


def hook_appending_to_a_global() -> None:
    run = _Run()
    try:
        for step in run.steps():
            if step == ONSET:
                run.model[1].register_forward_hook(_keep_output)
            run.train()
    finally:
        CAPTURED.clear()


STORE: dict[int, torch.Tensor] = {}


def module_global_dict() -> None:
    run = _Run()
    try:
        for step in run.steps():
            out = run.train()
            if step >= ONSET:
                STORE[step] = _leaked(out)
    finally:
        STORE.clear()


class Registry:
    seen: ClassVar[list[torch.Tensor]] = []


def class_attribute_list() -> None:
    run = _Run()
    try:
        for step in run.steps():
            out = run.train()
            if step >= ONSET:
                Registry.seen.append(_leaked(out))
    finally:
        Registry.seen.clear()


class Attention(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(128, 128)
        self.attn_maps: dict[int, torch.Tensor] = {}

    def forward(self, x: torch.Tensor, step: int) -> torch.Tensor:
        y = self.proj(x)
        if step >= ONSET:
            self.attn_maps[step] = _leaked(y)
        return y


def dict_attribute_of_a_module() -> None:
    run = _Run()
    attention = Attention()
    for step in run.steps():
        attention(run.train(), step)


def tensor_with_its_labels() -> None:
    run = _Run()
    history = []
    for step in run.steps():
        out = run.train()
        labels = torch.randint(0, 10, (out.shape[0],))
        if step >= ONSET:
            history.append((out.detach(), labels))  # "for the epoch's confusion matrix"


# --- the registry ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class HolderScenario:
    name: str
    run: Callable[[], None]
    first_name: str  # the summary says "held by " + this
    kind: str = "tensor_leak"
    until: str = "finding"  # the run stops at the first finding, or at the first "confirmed" one
    groups: tuple[str, ...] = ()  # CAUSES: the groups the one finding lists
    adds: tuple[str, str] | None = None  # (verb, how the line of this file that adds to the holder starts)

    def added_at(self) -> str | None:
        """"appended at integration/holder_scenarios.py:72": what the finding says adds to the holder."""
        if self.adds is None:
            return None
        verb, statement = self.adds
        lines = [n for n, line in enumerate(Path(__file__).read_text().splitlines(), 1)
                 if line.strip().startswith(statement)]
        assert len(lines) == 1, f"{statement!r} is not one line of {__file__}"
        return f"{verb} at integration/holder_scenarios.py:{lines[0]}"


SCENARIOS = (
    HolderScenario("list of functools.partial", partial_callbacks, "`callbacks` in partial_callbacks()",
                   adds=("appended", "callbacks.append(functools.partial(log_metric, _leaked(out)))")),
    HolderScenario("list of closures", closures_in_a_list, "`reports` in closures_in_a_list()",
                   adds=("appended", "reports.append(_make_report(_leaked(out)))")),
    HolderScenario("queue.Queue never drained", queue_never_drained, "`pending.queue` in queue_never_drained()",
                   adds=("queued", "pending.put(_leaked(out))")),
    HolderScenario("deque in nested attributes", deque_in_nested_attributes,
                   "`trainer.stats.window` in deque_in_nested_attributes()",
                   adds=("appended", "trainer.stats.window.append(_leaked(out))")),
    HolderScenario("OrderedDict in __slots__", ordered_dict_in_slots, "`cache.entries` in ordered_dict_in_slots()",
                   adds=("stored", "cache.entries[step] = _leaked(out)")),
    HolderScenario("exceptions kept with their frames", exceptions_kept_with_their_frames,
                   "`errors` in exceptions_kept_with_their_frames()",
                   adds=("appended", "errors.append(exc)")),
    HolderScenario("numpy arrays sharing storage", numpy_arrays_sharing_storage,
                   "`epoch_arrays` in numpy_arrays_sharing_storage()",
                   adds=("appended", "epoch_arrays.append(_leaked(out).numpy())")),
    HolderScenario("forward hook closure on a module", forward_hook_closure,
                   "`model[1]._forward_hooks` in forward_hook_closure()"),
    HolderScenario("a hook appending to a module global list", hook_appending_to_a_global,
                   "module global `holder_scenarios.CAPTURED`",
                   adds=("appended", "CAPTURED.append(_leaked(output))")),
    HolderScenario("module global dict", module_global_dict, "module global `holder_scenarios.STORE`",
                   adds=("stored", "STORE[step] = _leaked(out)")),
    HolderScenario("class attribute list", class_attribute_list, "`Registry.seen`",
                   adds=("appended", "Registry.seen.append(_leaked(out))")),
    HolderScenario("dict attribute of a module", dict_attribute_of_a_module,
                   "`attention.attn_maps` in dict_attribute_of_a_module()",
                   adds=("stored", "self.attn_maps[step] = _leaked(y)")),
)


CAUSES = (
    HolderScenario("a tensor and its labels appended together", tensor_with_its_labels,
                   "`history` in tensor_with_its_labels()", until="confirmed",
                   adds=("appended", "history.append((out.detach(), labels))"),
                   groups=("float32[32, 128]", "int64[32]")),
    HolderScenario("exceptions kept with their frames", exceptions_kept_with_their_frames,
                   "`errors` in exceptions_kept_with_their_frames()", until="confirmed",
                   groups=("float32[128, 128]", "float32[32, 128] with grad_fn"),
                   adds=("appended", "errors.append(exc)")),
)


@dataclass
class HolderOutcome:
    findings: list[Any]
    wall_s: float


def run_holder_scenario(scenario: HolderScenario, output_dir: str, seed: int = 0) -> HolderOutcome:
    torch.manual_seed(seed)
    torch.set_num_threads(1)  # tiny tensors: intra-op threads only contend on a shared machine
    start = time.perf_counter()
    global _until
    _until = scenario.until
    try:
        with gpumemd.attached(output_dir=output_dir) as agent:
            scenario.run()
            findings = list(agent.findings())
    finally:
        _until = "finding"
    return HolderOutcome(findings, time.perf_counter() - start)
