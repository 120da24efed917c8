"""who_holds: from a tensor to the name a human knows, in one line; and the census's holder column."""

from __future__ import annotations

import functools
import gc
import sys
import traceback
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch

import gpumemd
from gpumemd.probes.census import census_steps as census_probe
from gpumemd.probes.census.census_steps import take_census
from gpumemd.probes.holding.holders import who_holds, who_holds_stepwise

CACHE: dict[str, Any] = {}


# A partial, not a def: a helper's own parameter would be the nearest holder. A generous budget:
# the bounds are tested apart, and a loaded machine must not turn these into timing tests.
_holds = functools.partial(who_holds, time_budget_s=60.0)


class TrainerState:
    def __init__(self) -> None:
        self.history: list[torch.Tensor] = []


class SlotCache:
    __slots__ = ("entries",)

    def __init__(self) -> None:
        self.entries: dict[str, torch.Tensor] = {}


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(3, 3)
        self.features: dict[str, torch.Tensor] = {}


def test_a_list_held_by_a_local_is_named_by_the_variable_with_its_length() -> None:
    losses = [torch.zeros(3) for _ in range(1204)]

    line = _holds(losses[-1])

    assert line is not None
    assert line.startswith("`losses` in test_a_list_held_by_a_local_is_named_by_the_variable_with_its_length()")
    assert "test_census_referrers.py:" in line
    assert line.endswith("→ list of 1,204 items")


def test_a_direct_local_is_the_shortest_answer() -> None:
    cached = torch.zeros(5)

    line = _holds(cached)
    assert line is not None and line.startswith("`cached` in ")


def test_an_attribute_held_history_is_named_from_the_variable_that_holds_its_owner() -> None:
    state = _make_state()  # no local of this frame holds the list itself

    line = _holds(state.history[0])

    assert line is not None
    assert line.startswith("`state.history` in test_an_attribute_held_history_is_named_from_the_variable")
    assert line.endswith("→ list of 2 items")


def test_a_path_the_depth_bound_cuts_starts_at_the_nearest_owner_and_says_so() -> None:
    box = _Box(_nest(_make_state(), 12))  # deeper than the locals are followed down

    line = _holds(_innermost_state(box.value).history[0], max_depth=1)  # one level up: the list, no owner yet
    assert line is None
    line = _holds(_innermost_state(box.value).history[0], max_depth=2)  # the owner, not yet what names it

    assert line is not None and line.startswith("TrainerState.history → list of 2 items (path cut at depth ")


def _fails() -> None:
    act = torch.zeros(7)  # noqa: F841 - a local the traceback keeps
    raise ValueError("boom")


def test_a_cut_path_from_a_finished_frame_names_its_local_as_the_job_wrote_it() -> None:
    """At an OOM the failing frames are finished, kept by the exception being reported, which only
    gpumemd's hook holds: the climb stops at the frame. It read "frame _fails() → local `act` (path cut
    ...)"; the name, its function and line come first, as a running frame's local's do."""
    try:
        _fails()
    except ValueError as exc:
        box = _Box(_nest([exc], 12))  # the exception far below any name the locals reach
    line = _holds(_innermost(box.value).__traceback__.tb_next.tb_frame.f_locals["act"], max_depth=2)

    assert line is not None and line.startswith("`act` in _fails() at "), line
    assert line.endswith(", a finished frame (path cut at depth 2)"), line


_LIBRARY: dict[str, Any] = {}
exec(compile("def forward(input):\n    raise ValueError('boom')\n", f"{Path(traceback.__file__).parent}/fake_lib.py",
             "exec"), _LIBRARY)  # a library's frame: its file sits in the standard library's directory


def _calls_the_library() -> None:
    x = torch.zeros(7)
    _LIBRARY["forward"](x)


def test_a_cut_path_starts_at_the_jobs_frame_not_the_librarys() -> None:
    """Both failing frames hold the tensor, the job's as `x`, the library's as `input` (on the H200:
    torch's ``forward()``); which the heap lists first is chance, and the report named `input`."""
    try:
        _calls_the_library()
    except ValueError as exc:
        box = _Box(_nest([exc], 12))
    line = _holds(_innermost(box.value).__traceback__.tb_next.tb_next.tb_frame.f_locals["input"], max_depth=2)

    assert line is not None and line.startswith("`x` in _calls_the_library() at "), line


def _innermost_state(value: Any) -> TrainerState:
    while isinstance(value, list):
        value = value[0]
    return value  # type: ignore[no-any-return]


def _make_state() -> TrainerState:
    state = TrainerState()
    state.history += [torch.zeros(2), torch.zeros(2)]
    return state


def test_a_dict_inside_an_attribute_is_said_by_its_size_never_one_key() -> None:
    model = Model()
    model.features["preds"] = torch.zeros(4)
    model.features["labels"] = torch.zeros(4)

    line = _holds(model.features["preds"])

    assert line is not None and line.startswith("`model.features` in test_a_dict_inside_an_attribute")
    assert line.endswith("→ dict of 2 items") and "preds" not in line


def test_a_slot_attribute_is_named() -> None:
    holder = SlotCache()
    holder.entries["x"] = torch.zeros(1)

    line = _holds(holder.entries["x"])
    assert line is not None and line.startswith("`holder.entries` in test_a_slot_attribute_is_named()")
    assert line.endswith("→ dict of 1 item")


def test_a_module_global_is_named_by_module_and_name() -> None:
    CACHE["preds"] = torch.zeros(6)
    try:
        line = _holds(CACHE["preds"])
    finally:
        CACHE.clear()

    assert line is not None
    stored = next(n for n, text in enumerate(Path(__file__).read_text().splitlines(), 1)
                  if text == '    CACHE["preds"] = torch.zeros(6)')
    # the global, and the line of this file that stores into it
    assert line.startswith("module global `")
    assert line.endswith(f"test_census_referrers.CACHE`, stored at unit/test_census_referrers.py:{stored} "
                         "→ dict of 1 item")


def test_the_main_script_is_main_even_when_multiprocessing_aliases_it(monkeypatch: pytest.MonkeyPatch) -> None:
    import types

    script = types.ModuleType("__main__")
    script.kept = [torch.zeros(7)]  # type: ignore[attr-defined]
    # multiprocessing registers the main script a second time, as __mp_main__, after __main__
    monkeypatch.setitem(sys.modules, "__main__", script)
    monkeypatch.setitem(sys.modules, "__mp_main__", script)
    line = _holds(script.kept[0])  # type: ignore[attr-defined]
    assert line is not None and "__main__.kept" in line and "__mp_main__" not in line


def test_a_closure_variable_names_the_function() -> None:
    def make() -> Any:
        kept = [torch.zeros(8)]

        def use() -> int:
            return len(kept)

        return use

    fn = make()
    line = _holds(fn.__closure__[0].cell_contents[0])

    assert line is not None and line.startswith("`fn` in test_a_closure_variable_names_the_function() at ")
    assert line.endswith("→ `make.use` closure `kept` → list of 1 item")


def test_a_stored_exception_keeps_the_locals_of_the_frame_that_raised() -> None:
    def fails() -> None:
        activations = torch.zeros(77)
        raise ValueError(f"bad batch of {activations.numel()}")

    saved: list[BaseException] = []
    try:
        fails()
    except ValueError as exc:
        saved.append(exc)  # the classic: an exception kept "for the report" keeps the frame
    freed = weakref.ref(_tensor_local(saved[0].__traceback__.tb_next.tb_frame))  # type: ignore[union-attr]

    line = _holds(_tensor_local(saved[0].__traceback__.tb_next.tb_frame))  # type: ignore[union-attr]

    assert line is not None
    assert line.startswith("`saved` in test_a_stored_exception_keeps_the_locals_of_the_frame_that_raised() at ")
    assert line.endswith("→ list of 1 item → [i].__traceback__ → frame fails() → local `activations`")
    traceback.clear_frames(saved[0].__traceback__)
    gc.collect()
    assert freed() is None  # reading the finished frame's locals left nothing that keeps them


def _tensor_local(frame: Any) -> torch.Tensor:
    # not frame.f_locals: that would leave a snapshot of the locals on the frame
    [tensor] = [o for o in gc.get_referents(frame) if isinstance(o, torch.Tensor)]
    return tensor


def test_nothing_recognisable_gives_none_and_never_raises() -> None:
    assert who_holds(torch.zeros(2) + 1) is None  # a temporary: only the call itself holds it
    dead_proxy = weakref.proxy(TrainerState())
    assert who_holds(dead_proxy) is None or isinstance(who_holds(dead_proxy), str)


def test_depth_and_time_bounds_are_respected() -> None:
    deep = _Box(_nest(torch.zeros(1), 30))  # deeper than the locals are followed down, and than 3 scans

    assert who_holds(_innermost(deep.value), max_depth=3) is None
    assert who_holds(_innermost(deep.value), time_budget_s=0.0) is None
    # ~21 heap scans: a generous budget so a loaded machine cannot turn this into a timing test
    line = who_holds(_innermost(deep.value), max_depth=40, time_budget_s=120.0)
    assert line is not None
    assert line.startswith("`deep.value` in test_depth_and_time_bounds_are_respected() at ")
    assert line.endswith(" → list of 1 item" * 30)


def test_a_stepwise_look_up_goes_on_at_the_next_step_end_from_the_level_it_reached() -> None:
    deep = _Box(_nest(torch.zeros(1), 30))
    assert who_holds(_innermost(deep.value), max_depth=40, time_budget_s=0.0) is None  # one pause: too deep
    # no time at all: a level or so per step end, until it meets what the locals reach
    search = who_holds_stepwise(_innermost(deep.value), max_depth=40, time_budget_s=0.0, pauses=40)
    pauses = 0
    with pytest.raises(StopIteration) as done:
        while True:
            next(search)
            pauses += 1
    assert pauses >= 2
    assert done.value.value.text.startswith("`deep.value` in test_a_stepwise_look_up_goes_on_at_the_next_step_end")
    assert done.value.value.text.endswith(" → list of 1 item" * 30)


def _nest(value: Any, depth: int) -> Any:
    for _ in range(depth):
        value = [value]
    return value


class _Box:
    def __init__(self, value: Any) -> None:
        self.value = value


def _innermost(value: Any) -> Any:
    while isinstance(value, list):
        value = value[0]
    return value


def test_reading_frame_locals_does_not_keep_deleted_locals_alive() -> None:
    big = torch.zeros(1000)
    ref = weakref.ref(big)
    other = [torch.zeros(1)]
    who_holds(other[0])  # reads this frame's locals while `big` is one of them

    del big

    assert ref() is None


def test_who_holds_is_exported_lazily() -> None:
    assert gpumemd.who_holds is who_holds
    assert "who_holds" in gpumemd.__all__
    assert "gpumemd.probes.holding.holders" in sys.modules


def test_census_fills_holders_only_for_growing_anonymous_groups(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(census_probe, "HOLDERS_TIME_BUDGET_S", 60.0)
    leak: list[torch.Tensor] = []
    state = TrainerState()
    before = take_census(holders=0)
    for _ in range(5):
        leak.append(torch.zeros(257, 3))
        state.history.append(torch.zeros(263, 3))

    after = take_census(holders=3, previous=before)

    [listed] = [g for g in after.groups if g.key.shape == (257, 3)]
    assert listed.holder is not None and listed.holder.startswith("`leak` in test_census_fills_holders")
    assert listed.holder.endswith("→ list of 5 items")
    [attributed] = [g for g in after.groups if g.key.shape == (263, 3)]
    assert attributed.holder is not None and attributed.holder.startswith("`state.history` in test_census_fills")
    assert attributed.holder.endswith("→ list of 5 items")
    deltas = {d.key.shape: d for d in after.diff(before)}
    assert deltas[(257, 3)].holder == listed.holder and deltas[(257, 3)].count_delta == 5
    assert all(g.holder is None for g in after.groups if g.key.name is not None)
