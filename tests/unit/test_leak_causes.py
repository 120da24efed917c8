"""One finding per cause (``analysis.leak_causes``): count findings under one root at about the
same rate are one finding; the grouping is sticky across evaluations and a cause clears once."""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

import pytest

from gpumemd.analysis.leak_causes import (
    NO_CAUSES,
    Causes,
    Key,
    accounting_for,
    cause_root,
    merge_causes,
    newly_critical,
    state_changes,
    withdrawn,
)
from gpumemd.analysis.leak_headline import mention, nearer_line, short_path
from gpumemd.components.leak_findings import LeakFindings
from gpumemd.components.leak_options import LeakOptions
from gpumemd.config import Config
from gpumemd.records.device import CPU
from gpumemd.records.findings import Culprit, Finding

HISTORY = "`history` in main() at train.py:5 → list of {n} items → tuple of 2 items"
ERRORS = "`errors` in main() at train.py:3 → list of {n} items → [i].__traceback__ → frame step() → local `{local}`"


def _finding(group: str, holder: str | None, *, rate: float = 1.0, per_tensor: float = 1024.0,
             state: str = "suspected", onset: int | None = 60, step: int = 600) -> Finding:
    series = f"tensors{{device=cpu,group={group}}}"
    active = state != "cleared"
    culprit = Culprit(description=group, count_delta=round(rate * (step - 60)),
                      bytes_delta=round(rate * (step - 60) * per_tensor), holder=holder)
    slope = rate * per_tensor
    return Finding(
        kind="tensor_leak", series=series, state=state, slope_bytes_per_step=slope, slope_low=0.9 * slope,
        slope_high=1.1 * slope, onset_step=onset, growth_bytes=round(slope * (step - 60)),
        steps_to_oom=1e6 / slope if active else None, first_step=600, updated_step=step,
        summary=f"tensor leak {state} on {series}", headline=f"tensor leak {state}", device=CPU,
        culprits=(culprit,) if active else (), tensors_per_step=rate,
        hours_to_oom=1e6 / slope / 3600 if active else None, severity="warning" if active else None, group=group,
    )


def _key(f: Finding) -> Key:
    return (f.series, f.phase)


def _run(*evaluations: list[Finding]) -> tuple[list[Causes], list[list[Finding]]]:
    """Each evaluation's findings (every one changed), as the component feeds them."""
    current = NO_CAUSES
    history: list[Causes] = []
    reported: list[list[Finding]] = []
    for findings in evaluations:
        previous, current = current, merge_causes({_key(f): f for f in findings}, current)
        history.append(current)
        reported.append(state_changes(previous, current, [_key(f) for f in findings]))
    return history, reported


def test_the_root_is_the_path_up_to_its_first_growing_container() -> None:
    assert cause_root(HISTORY.format(n=501)) == "`history` in main() at train.py:5"
    assert cause_root(ERRORS.format(n=40, local="act")) == "`errors` in main() at train.py:3"
    assert cause_root("`buffers` in f() at x.py:1 → dict of 3 items → [k] → list of 500 items") == \
        "`buffers` in f() at x.py:1 → dict → [k]"
    assert cause_root("function `<lambda>` closure `value`") == "function `<lambda>` closure `value`"
    assert cause_root(None) is None


def test_same_root_same_rate_is_one_finding_with_the_total_rate() -> None:
    logits = _finding("float32[32, 10]", HISTORY.format(n=541), per_tensor=1280, onset=61)
    labels = _finding("int64[32]", HISTORY.format(n=541), per_tensor=256, onset=60)

    [causes], [reported] = _run([logits, labels])

    assert len(causes.findings) == 1
    finding = next(iter(causes.findings.values()))
    assert [c.description for c in finding.culprits] == ["float32[32, 10]", "int64[32]"]
    assert finding.tensors_per_step == 2.0
    assert finding.slope_bytes_per_step == 1280 + 256
    assert finding.onset_step == 60  # the earliest
    assert finding.steps_to_oom is not None and abs(finding.steps_to_oom - 1e6 / (1280 + 256)) < 1
    assert "2 groups (float32[32, 10], int64[32])" in finding.summary
    assert "+2 tensors/step" in finding.headline and "held by `history` in main()" in finding.headline
    assert len(finding.headline) <= 200 - len("gpumemd: ")
    assert reported == [finding]  # one line, not two


def test_the_states_of_one_metric_are_one_finding_named_by_the_metric() -> None:
    """A torchmetrics metric never reset keeps every update() in each of its states (BinaryAUROC's
    preds and target): two lists, one cause, one fix (its reset()). They were two findings, "held by
    `auroc.target`" and "held by `auroc.preds`", each with the same advice."""
    state = "`auroc.{name}` in <module>() at m.py:8 (a BinaryAUROC's state, kept until reset()) → list of {n} items"
    preds = _finding("float32[64]", state.format(name="preds", n=702), per_tensor=256)
    target = _finding("int64[64]", state.format(name="target", n=702), per_tensor=512)
    metric = "`auroc` in <module>() at m.py:8 (a BinaryAUROC: its states kept until reset())"
    assert cause_root(preds.culprits[0].holder) == cause_root(target.culprits[0].holder) == metric

    [causes], [reported] = _run([target, preds])

    [finding] = reported
    assert list(causes.findings.values()) == [finding]
    assert f"+2 tensors/step (~768 B/step, 2 groups) held by {metric}, since step 60" in finding.headline, \
        finding.headline
    assert mention(finding).startswith(f"tensor leak held by {short_path(metric)} (suspected"), mention(finding)
    # Two lists of the job's own under one object are two holders to fix: not merged.
    own = "`self.{name}` in Eval.step() at e.py:4 → list of {n} items"
    _, [two] = _run([_finding("float32[64]", own.format(name="preds", n=702)),
                     _finding("int64[64]", own.format(name="target", n=702))])
    assert len(two) == 2


def test_a_cause_states_the_host_growth_its_projection_is_made_from() -> None:
    """A cause whose member states host RSS's growth (``_stated_host``: the heap its CPU tensors pin,
    far above their own bytes) says it too: its out-of-memory comes from it, and "~4.0 KiB/step ...
    out of memory in ~5 min" without it read as a contradiction (a DataLoader batch's view kept a
    step, a 2-layer transformer: RSS +1.3 MiB/step)."""
    host = 1.3 * 2**20
    batch = dataclasses.replace(_finding("int64[32]", HISTORY.format(n=541), per_tensor=4096),
                                host_bytes_per_step=host, steps_to_oom=2e10 / host, hours_to_oom=2e10 / host / 3600)
    loss = _finding("float32[] with grad_fn", HISTORY.format(n=541), per_tensor=64)

    _, [reported] = _run([batch, loss])

    [finding] = reported
    assert finding.host_bytes_per_step == host
    assert "+2 tensors/step (~4.1 KiB/step, host RSS +1.3 MiB/step)" in finding.summary, finding.summary
    assert "+2 tensors/step (~4.1 KiB/step, host RSS +1.3 MiB/step, 2 groups) held by `history`" in \
        finding.headline, finding.headline
    assert len(finding.headline) <= 200 - len("gpumemd: ")
    # without a member that states it, neither does the cause
    [plain], _ = _run([_finding("int64[32]", HISTORY.format(n=541), per_tensor=4096), loss])
    assert next(iter(plain.findings.values())).host_bytes_per_step is None


def test_a_kept_frames_locals_are_one_finding() -> None:
    act = _finding("float32[128, 128]", ERRORS.format(n=40, local="act"), per_tensor=65536)
    out = _finding("float32[32, 128] with grad_fn", ERRORS.format(n=40, local="out"), per_tensor=16384)

    [causes], _ = _run([act, out])

    [finding] = causes.findings.values()
    assert "frame step()" in finding.headline and "local `act`" in finding.summary and "local `out`" in finding.summary


def test_different_roots_stay_separate() -> None:
    kept = _finding("float32[32, 10]", HISTORY.format(n=541))
    other = _finding("int64[32]", "`labels_seen` in main() at train.py:9 → list of 541 items")

    [causes], [reported] = _run([kept, other])

    assert list(causes.findings.values()) == [kept, other]  # each one unchanged
    assert reported == [kept, other]


def test_rates_far_apart_stay_separate() -> None:
    fast = _finding("float32[32, 10]", HISTORY.format(n=541), rate=4.0)
    slow = _finding("int64[32]", HISTORY.format(n=541), rate=1.0)

    [causes], _ = _run([fast, slow])

    assert len(causes.findings) == 2


def test_counts_on_other_devices_or_bytes_series_are_never_summed() -> None:
    host = _finding("int64[32]", HISTORY.format(n=541))
    bytes_series = dataclasses.replace(_finding("float32[32, 10]", HISTORY.format(n=541)),
                                       series="census_bytes{device=cpu}", tensors_per_step=None)

    [causes], _ = _run([host, bytes_series])

    assert len(causes.findings) == 2


def test_the_cause_is_stable_across_evaluations() -> None:
    # the second group is raised one evaluation late; the rates then drift apart; the key stays
    a1 = _finding("float32[32, 10]", HISTORY.format(n=501), step=600)
    b2 = _finding("int64[32]", HISTORY.format(n=551), step=650)
    a3 = _finding("float32[32, 10]", HISTORY.format(n=601), step=700, state="confirmed")
    b3 = _finding("int64[32]", HISTORY.format(n=601), step=700, rate=3.0)

    history, reported = _run([a1], [a1, b2], [a3, b3], [a3, b3])  # every one "changed": the worst case

    assert [list(c.findings) for c in history] == [[_key(a1)]] * 4
    assert history[0].findings[_key(a1)] == a1  # alone, it is its own finding
    assert history[1].findings[_key(a1)].tensors_per_step == 2.0
    assert [[f.state for f in r] for r in reported] == [["suspected"], [], ["confirmed"], []]


def test_a_cause_clears_once_and_never_falls_back_to_suspected() -> None:
    a = _finding("float32[32, 10]", HISTORY.format(n=501), state="confirmed")
    b = _finding("int64[32]", HISTORY.format(n=501))
    a_cleared = _finding("float32[32, 10]", None, state="cleared")
    b_cleared = _finding("int64[32]", None, state="cleared")

    history, reported = _run([a, b], [a_cleared, b], [a_cleared, b_cleared], [a_cleared, b_cleared])

    assert [next(iter(c.findings.values())).state for c in history] == ["confirmed", "confirmed", "cleared",
                                                                        "cleared"]
    assert [[f.state for f in r] for r in reported] == [["confirmed"], [], ["cleared"], []]
    cleared = next(iter(history[2].findings.values()))
    assert cleared.culprits == () and "growth stopped" in cleared.summary and cleared.severity is None
    # one group of two cleared: the finding goes on with the other's rate alone
    assert next(iter(history[1].findings.values())).tensors_per_step == 1.0


def test_a_withdrawn_finding_leaves_its_cause() -> None:
    a = _finding("float32[32, 10]", HISTORY.format(n=501))
    b = _finding("int64[32]", HISTORY.format(n=501))

    history, _ = _run([a, b], [b])

    assert list(history[1].findings.values()) == [b]
    assert list(history[1].findings) == [_key(a)]  # the cause keeps its key


def test_a_cause_a_person_was_told_of_and_that_is_withdrawn_is_listed_once() -> None:
    host = dataclasses.replace(_finding("host", None), kind="host_leak", series="host_rss_bytes", culprits=(),
                               tensors_per_step=None)
    kept = _finding("float32[64]", HISTORY.format(n=501), state="confirmed")
    before = merge_causes({_key(host): host, _key(kept): kept}, NO_CAUSES)
    after = merge_causes({_key(kept): kept}, before)  # host RSS explained by the tensors: withdrawn

    assert withdrawn(before, after) == [host]
    assert withdrawn(after, after) == []
    assert accounting_for(host, after) == kept
    cleared = dataclasses.replace(host, state="cleared")
    assert withdrawn(merge_causes({_key(cleared): cleared}, NO_CAUSES), NO_CAUSES) == []  # its end was said


def test_a_cause_that_becomes_critical_after_its_state_change_is_said_once() -> None:
    """A CPU leak's projection fell from ~75 days to ~6 min once host RSS's growth was stated (a `gpumemd
    run` of a loop keeping a scalar a step): the confirmed line had said days, and nothing said minutes."""
    days = dataclasses.replace(_finding("float32[]", HISTORY.format(n=700), state="confirmed"), hours_to_oom=1800.0)
    minutes = dataclasses.replace(days, steps_to_oom=4e5, hours_to_oom=0.1, severity="critical",
                                  headline="tensor leak confirmed: host RSS +55 KiB/step, out of memory in ~6 min")
    before = merge_causes({_key(days): days}, NO_CAUSES)
    after = merge_causes({_key(minutes): minutes}, before)
    assert newly_critical(before, set()) == []  # days away: nothing to say beyond the state change
    (key, finding), = newly_critical(after, set())
    assert finding is minutes
    assert newly_critical(after, {key}) == []  # said once an episode
    line = nearer_line(finding, before.findings[key])
    assert line == f"{minutes.headline} (was ~75 days)", line
    assert nearer_line(finding, None) == minutes.headline
    # a cause said without a projection (a retained graph: its nodes' bytes unknown) that a group with
    # bytes joins: the line is an update of the one said, not a new state change
    unprojected = dataclasses.replace(days, steps_to_oom=None, hours_to_oom=None)
    assert nearer_line(finding, unprojected) == f"{minutes.headline} (not projected before)"
    cleared = dataclasses.replace(minutes, state="cleared", severity=None)
    assert newly_critical(merge_causes({_key(cleared): cleared}, after), set()) == []


def test_the_component_says_the_nearer_projection_once(tmp_path: Any, caplog: pytest.LogCaptureFixture) -> None:
    days = dataclasses.replace(_finding("float32[]", HISTORY.format(n=700), state="confirmed"), hours_to_oom=1800.0)
    minutes = dataclasses.replace(days, hours_to_oom=0.1, severity="critical", headline="out of memory in ~6 min")
    leak = LeakFindings(Config().options(LeakOptions), census=None, wall_clock=time.time)
    before = merge_causes({_key(days): days}, NO_CAUSES)
    with caplog.at_level(logging.WARNING, logger="gpumemd"):
        for _ in range(3):  # three evaluations at which it stays critical
            leak._causes = merge_causes({_key(minutes): minutes}, before)
            leak._say_nearer(before, reported=[])
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["gpumemd: out of memory in ~6 min (was ~75 days)"], lines
