"""The holder path, written as the user would write it: rendering of each kind of hop, from the
objects of a path (``holder_paths.render``), and the climb's roots and cuts (``who_holds``)."""

from __future__ import annotations

import collections
import functools
import queue
from pathlib import Path
from typing import Any

import torch

from gpumemd.probes.holding.holder_paths import Root, render
from gpumemd.probes.holding.holders import who_holds

_holds = functools.partial(who_holds, time_budget_s=60.0)  # generous: the bounds are tested apart

LOCAL = Root("kept", "`", "` in train() at train.py:7")


class Stats:
    def __init__(self) -> None:
        self.window: collections.deque[Any] = collections.deque()


class Trainer:
    def __init__(self) -> None:
        self.stats = Stats()


class Slots:
    __slots__ = ("buf",)

    def __init__(self) -> None:
        self.buf: collections.OrderedDict[int, Any] = collections.OrderedDict()


class Registry:
    seen: list[Any] = []  # noqa: RUF012 - the class attribute is the point


def _namespace(obj: object) -> dict[str, Any]:
    return obj.__dict__


def _line(root: Root, chain: list[Any]) -> str:
    return render(root, chain).text


def test_attributes_join_into_one_dotted_name_and_a_container_is_said_by_its_size() -> None:
    trainer = Trainer()
    t = torch.zeros(1)
    trainer.stats.window.extend([t, torch.zeros(1)])

    line = _line(LOCAL, [trainer, _namespace(trainer), trainer.stats, _namespace(trainer.stats),
                          trainer.stats.window, t])

    assert line == "`kept.stats.window` in train() at train.py:7 → deque of 2 items"
    bounded = collections.deque([t], maxlen=1000)
    assert _line(LOCAL, [bounded, t]).endswith("→ deque of 1 item (maxlen 1,000)")


def test_a_path_whose_only_growable_container_is_a_bounded_deque_has_its_bound() -> None:
    """What such a deque holds stops growing at its maxlen; another container that can grow on the
    path (a list of deques, a dict of them) may keep growing, so the path then has no bound."""
    t = torch.zeros(1)
    trainer = Trainer()
    trainer.stats.window = collections.deque([t, torch.zeros(1)], maxlen=1000)
    through_attributes = [trainer, _namespace(trainer), trainer.stats, _namespace(trainer.stats),
                          trainer.stats.window, t]
    assert render(LOCAL, through_attributes).bound == (1000, 2)
    bounded = collections.deque([(t, 1)], maxlen=10)
    assert render(LOCAL, [bounded, bounded[0], t]).bound == (10, 1)  # a tuple item cannot grow
    assert render(LOCAL, [[bounded], bounded, bounded[0], t]).bound is None  # the list of deques can
    assert render(LOCAL, [{"loss": bounded}, bounded, bounded[0], t]).bound is None
    assert render(LOCAL, [collections.deque([t]), t]).bound is None  # no maxlen
    assert render(LOCAL, [trainer, _namespace(trainer), trainer.stats]).bound is None  # no container


def test_a_dict_is_said_by_its_size_never_by_one_key() -> None:
    t = torch.zeros(1)
    cache = {642: t, 643: torch.zeros(1)}

    assert _line(LOCAL, [cache, t]) == "`kept` in train() at train.py:7 → dict of 2 items"
    ordered = collections.OrderedDict(a=t)
    assert _line(LOCAL, [ordered, t]) == "`kept` in train() at train.py:7 → OrderedDict of 1 item"


def test_sizes_are_read_when_the_line_is_written() -> None:
    t = torch.zeros(1)
    kept = [t]
    path = [kept, t]
    before = _line(LOCAL, path)
    kept.append(torch.zeros(1))

    assert before.endswith("list of 1 item") and _line(LOCAL, path).endswith("list of 2 items")


def test_a_partial_in_a_list_reads_as_its_argument() -> None:
    t = torch.zeros(1)
    callback = functools.partial(print, t)
    callbacks = [callback]

    line = _line(LOCAL, [callbacks, callback, callback.args, t])

    assert line == "`kept` in train() at train.py:7 → list of 1 item → partial.args[0]"


def _make(value: Any) -> Any:
    return lambda: value


def test_a_closure_reads_as_the_function_and_its_variable() -> None:
    t = torch.zeros(1)
    fn = _make(t)
    assert fn.__closure__ is not None
    cell = fn.__closure__[0]

    line = _line(LOCAL, [[fn], fn, fn.__closure__, cell, t])

    assert line == "`kept` in train() at train.py:7 → list of 1 item → `_make.<lambda>` closure `value`"


def test_a_default_reads_as_the_parameter() -> None:
    t = torch.zeros(1)

    def step(x: int, cache: Any = t) -> None: ...

    assert step.__defaults__ is not None
    line = _line(Root("step"), [step, step.__defaults__, t])

    assert line.endswith("default `cache`")


def test_a_bound_method_reads_through_self() -> None:
    trainer = Trainer()
    method = trainer.__init__  # any bound method of it
    namespace = _namespace(trainer)

    line = _line(LOCAL, [{1: method}, method, trainer, namespace, trainer.stats])

    assert line == "`kept` in train() at train.py:7 → dict of 1 item → `Trainer.__init__`.__self__.stats"


def test_an_ndarray_reads_as_its_base() -> None:
    t = torch.zeros(2)
    arr = t.numpy()

    assert _line(LOCAL, [[arr], arr, arr.base]) == "`kept` in train() at train.py:7 → list of 1 item → [i].base"


def test_module_children_read_as_the_user_indexes_them() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU())
    relu = model[1]
    hooks = relu._forward_hooks

    line = _line(Root("model"), [model, _namespace(model), model._modules, relu, _namespace(relu), hooks])

    assert line == "`model[1]._forward_hooks`"


def test_a_stored_exception_reads_down_to_the_frame_local() -> None:
    def fails() -> None:
        act = torch.zeros(3)
        raise ValueError(act.shape)

    errors: list[BaseException] = []
    try:
        fails()
    except ValueError as exc:
        errors.append(exc)
    tb = errors[0].__traceback__
    assert tb is not None and tb.tb_next is not None
    frame = tb.tb_next.tb_frame
    act = next(v for v in frame.f_locals.values() if isinstance(v, torch.Tensor))

    line = _line(Root("errors"), [errors, errors[0], tb, tb.tb_next, frame, act])

    assert line == "`errors` → list of 1 item → [i].__traceback__ → frame fails() → local `act`"


def test_the_climb_names_each_kind_of_root() -> None:
    pending: queue.Queue[torch.Tensor] = queue.Queue()
    pending.put(torch.zeros(4))
    line = _holds(pending.queue[0])
    assert line is not None and line.startswith("`pending.queue` in test_the_climb_names_each_kind_of_root() at ")
    assert line.endswith("→ deque of 1 item")

    Registry.seen.append(torch.zeros(5))
    try:
        # the class attribute, and the line that adds to it (this function's append, above)
        added = _line_of("    Registry.seen.append(torch.zeros(5))")
        expected = f"`Registry.seen`, appended at unit/test_holder_paths.py:{added} → list of 1 item"
        assert _holds(Registry.seen[0]) == expected
    finally:
        Registry.seen.clear()

    holder = Slots()
    holder.buf[0] = torch.zeros(6)
    line = _holds(holder.buf[0])
    assert line is not None and line.startswith("`holder.buf` in ") and line.endswith("→ OrderedDict of 1 item")


def _line_of(text: str) -> int:
    """The line of this file that is ``text``."""
    return Path(__file__).read_text().splitlines().index(text) + 1


def test_the_line_that_adds_to_the_holder_follows_where_it_lives() -> None:
    kept: list[torch.Tensor] = []
    for _ in range(2):
        kept.append(torch.zeros(9))
    never = [torch.zeros(10)]

    line = _holds(kept[0])
    unchanged = _holds(never[0])

    added = _line_of("        kept.append(torch.zeros(9))")
    assert line is not None and line.endswith(f", appended at unit/test_holder_paths.py:{added} → list of 2 items")
    assert unchanged is not None and "ed at" not in unchanged  # nothing adds to it: no line is guessed


def test_an_array_the_gc_does_not_track_is_found_from_its_referrers() -> None:
    arrays = [torch.ones(7).numpy() for _ in range(3)]

    line = _holds(arrays[1].base)

    assert line is not None
    assert line.startswith("`arrays` in test_an_array_the_gc_does_not_track_is_found_from_its_referrers() at ")
    assert line.endswith("→ list of 3 items → [i].base")


def test_the_nearest_assigned_variable_is_preferred_to_a_parameter() -> None:
    kept = [torch.zeros(8)]
    line = _looked_up_inside(kept)

    assert line is not None and line.startswith("`kept` in test_the_nearest_assigned_variable_is_preferred")


def _looked_up_inside(values: list[torch.Tensor]) -> str | None:
    return _holds(values[0])



_RUNNER = '''
def run_tests(test):
    # a test runner's items: 64 x 64 x 64 tracked objects, three levels down (the search follows the
    # newest 64 items of a container)
    collected = [[[[] for _ in range(64)] for _ in range(64)] for _ in range(64)]
    return test()
'''


def test_the_jobs_own_frames_are_searched_before_a_runners() -> None:
    # A library frame (a test runner, a framework's loop) below the job's, whose locals reach more
    # objects than the downward search may visit: the job's own path is still found without climbing.
    namespace: dict[str, Any] = {"__name__": "runner"}
    exec(compile(_RUNNER, "/venv/lib/python3.11/site-packages/runner.py", "exec"), namespace)

    def train() -> str | None:
        trainer = Trainer()
        trainer.stats.window.append([{"acts": torch.ones(2)}])  # five levels below the local
        return who_holds(trainer.stats.window[0][0]["acts"], max_depth=1, time_budget_s=60.0)

    holder = namespace["run_tests"](train)
    assert holder is not None and holder.startswith("`trainer.stats.window` in train()"), holder


def batches() -> Any:
    produced: list[Any] = []
    while True:
        produced.append(torch.zeros(1))
        yield len(produced)


def test_a_suspended_generators_local_is_named() -> None:
    stream = batches()
    next(stream)
    next(stream)
    kept = stream.gi_frame.f_locals["produced"]
    t = kept[0]
    del kept
    line = _line(LOCAL, [stream, stream.gi_frame.f_locals["produced"], t])

    assert line == "`kept` in train() at train.py:7 → local `produced` of generator `batches` → list of 2 items"


class _Connector:
    """A framework's object (its class says it is json's: not the job's code)."""


_Connector.__module__ = "json"


class OwnModule:
    def __init__(self) -> None:
        self.outputs: list[Any] = []


def test_a_path_through_a_librarys_private_attributes_starts_at_the_jobs_object() -> None:
    # Lightning: `t._data_connector._datahook_selector.model.training_step_outputs`, another time
    # `t._accelerator_connector._strategy_flag._lightning_module...`: the job wrote neither.
    trainer, own, t = _Connector(), OwnModule(), torch.zeros(3)
    trainer._strategy = _Connector()  # type: ignore[attr-defined]
    trainer._strategy.model = own  # type: ignore[attr-defined]
    own.outputs.append(t)
    chain = [trainer, _namespace(trainer), trainer._strategy, _namespace(trainer._strategy),  # type: ignore[attr-defined]
             own, _namespace(own), own.outputs, t]
    added = _line_of("    own.outputs.append(t)")
    assert _line(LOCAL, chain) == f"OwnModule.outputs, appended at unit/test_holder_paths.py:{added} → list of 1 item"
    public = _Connector()
    public.model = own  # type: ignore[attr-defined]
    # a public path is the job's word: kept as it is
    assert _line(LOCAL, [public, _namespace(public), own, _namespace(own), own.outputs, t]) == \
        "`kept.model.outputs` in train() at train.py:7 → list of 1 item"


class _Metric:
    """torchmetrics' base class, as the holder path tells it (by name and module: no torchmetrics needed)."""


_Metric.__name__ = _Metric.__qualname__ = "Metric"
_Metric.__module__ = "torchmetrics.metric"


class BinaryAUROC(_Metric):
    def __init__(self) -> None:
        self._defaults = {"preds": [], "target": []}
        self.preds: list[Any] = []
        self.extra: list[Any] = []  # not a state: said as any attribute


def test_a_torchmetrics_state_says_it_is_kept_until_reset() -> None:
    # A metric updated every step and never reset keeps every update(); the fix is its reset(), which
    # the exit line's advice reads from this note (announce.fix_words).
    auroc, t = BinaryAUROC(), torch.zeros(2)
    auroc.preds.append(t)
    auroc.extra.append(t)
    assert _line(LOCAL, [auroc, _namespace(auroc), auroc.preds, t]) == (
        "`kept.preds` in train() at train.py:7 (a BinaryAUROC's state, kept until reset()) → list of 1 item")
    assert _line(LOCAL, [auroc, _namespace(auroc), auroc.extra, t]) == (
        "`kept.extra` in train() at train.py:7 → list of 1 item")
