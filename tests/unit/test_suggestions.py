"""Each suggestion rule alone, on hand-built breakdowns and findings (pure), then how ``suggest``
orders them: the fix of a leak the verdict blames first, a size bug before everything."""

from __future__ import annotations

from typing import Any

import pytest

from gpumemd.analysis import suggestions as rules
from gpumemd.analysis.suggestion_facts import Facts
from gpumemd.analysis.suggestions import suggest
from gpumemd.records.device import Device
from gpumemd.records.findings import Culprit, Finding
from gpumemd.records.oom import Breakdown, BreakdownItem, LeakCause

MiB, GiB = 2**20, 2**30


def _breakdown(device: str = "cuda:0", total: int = 16 * GiB, verdict: str = "capacity", *,
               leak: LeakCause | None = None, requested: int | None = GiB, largest: int | None = None,
               **items: int) -> Breakdown:
    return Breakdown(device=Device.parse(device), total_bytes=total,
                     items=tuple(BreakdownItem(k, k, n) for k, n in items.items()),
                     requested_bytes=requested, allocated_bytes=None, reserved_bytes=None,
                     largest_free_block_bytes=largest, device_free_bytes=None, verdict=verdict,
                     verdict_why="the working set does not fit", leak=leak)


def _leak(kind: str = "tensor_leak", held: int = 3 * GiB, **over: Any) -> LeakCause:
    base: dict[str, Any] = dict(holder="`kept`", held_bytes=held, graph_bytes=held if kind == "graph_leak" else 0,
                                tensor_count=1500, description="float32[512, 1024]", source="finding", kind=kind,
                                state="confirmed", slope_bytes_per_step=2 * MiB, onset_step=31,
                                holder_detail="`kept` in main() at train.py:12 → list of 1,500 items",
                                series="tensors{device=cuda:0,group=float32[512, 1024]}",
                                summary="`kept` grew ~2.00 MiB/step since step 31 and held 3.00 GiB")
    base.update(over)
    return LeakCause(**base)


def _finding(state: str = "confirmed", holder: str | None = "`losses` in main() at train.py:57 → list of 300 items",
             **over: Any) -> Finding:
    base: dict[str, Any] = dict(
        kind="graph_leak", series="allocated_bytes{device=0}", state=state, slope_bytes_per_step=MiB,
        slope_low=0.9 * MiB, slope_high=1.1 * MiB, onset_step=50, growth_bytes=300 * MiB, steps_to_oom=10.0,
        first_step=120, updated_step=350,
        summary="retained autograd graph confirmed on allocated_bytes{device=0}, +1 MiB/step; +1 tensor/step: "
                "float32[] with grad_fn, keeping ~1 MiB/step of autograd graph alive",  # no full stop, as written
        culprits=(Culprit("float32[] with grad_fn", 300, 300 * MiB, holder=holder),), device=Device.cuda(0))
    base.update(over)
    return Finding(**base)


def _kinds(out: list[Any]) -> list[str]:
    return [s.kind for s in out]


# --- one rule at a time --------------------------------------------------------------------------


def test_fix_leak_names_the_holder_and_gives_back_what_it_held() -> None:
    [s] = rules.fix_leak(Facts(_breakdown(leak=_leak())))
    assert s.kind == "fix_leak" and s.saving_bytes == 3 * GiB
    assert "`kept`" in s.title and "confirmed tensor leak" in s.title
    assert s.why.endswith(".") and "since step 31" in s.why
    assert "`kept`" in s.how and "deque" in s.how
    [graph] = rules.fix_leak(Facts(_breakdown(leak=_leak("graph_leak"))))
    assert "loss.item()" in graph.how
    assert rules.fix_leak(Facts(_breakdown())) == []


def test_fix_confirmed_findings_ends_its_sentences_and_skips_what_the_leak_covers() -> None:
    [s] = rules.fix_confirmed_findings(Facts(_breakdown(), findings=[_finding()]))
    assert ". It grew 300.00 MiB since step 50" in s.why  # the summary had no full stop: "alive It grew" no more
    assert "alive It grew" not in s.why
    assert rules.fix_confirmed_findings(Facts(_breakdown(), findings=[_finding(state="suspected")])) == []
    covered = _leak(holder_detail="`losses` in main() at train.py:57 → list of 310 items", series="other")
    assert rules.fix_confirmed_findings(Facts(_breakdown(leak=covered), findings=[_finding()])) == []


def test_no_grad_eval_only_outside_training() -> None:
    b = _breakdown(parameters=GiB, invisible=2 * GiB)
    [s] = rules.no_grad_eval(Facts(b, phase="eval"))
    assert s.saving_bytes == 2 * GiB and "'eval'" in s.title
    assert rules.no_grad_eval(Facts(b, phase="train")) == []


def test_activation_checkpointing_when_activations_dominate() -> None:
    [s] = rules.activation_checkpointing(Facts(_breakdown(parameters=GiB, invisible=3 * GiB)))
    assert s.saving_bytes == int(3 * GiB * 0.6)
    assert rules.activation_checkpointing(Facts(_breakdown(parameters=9 * GiB, invisible=GiB))) == []


def test_smaller_micro_batch_when_activations_dominate() -> None:
    [s] = rules.smaller_micro_batch(Facts(_breakdown(parameters=GiB, graph_retained=4 * GiB)))
    assert s.saving_bytes == 2 * GiB
    assert rules.smaller_micro_batch(Facts(_breakdown(parameters=9 * GiB, invisible=GiB))) == []


def test_leaked_graphs_are_not_activations() -> None:
    # 2.6 GiB of a leak's autograd graph: in the "leaked" item, so no activation advice is sized on it.
    b = _breakdown(leak=_leak("graph_leak", held=2600 * MiB), leaked=2600 * MiB, parameters=GiB, invisible=100 * MiB)
    facts = Facts(b)
    assert facts.acts == 100 * MiB
    assert rules.activation_checkpointing(facts) == [] and rules.smaller_micro_batch(facts) == []
    assert _kinds(suggest(b)) == ["fix_leak"]


def test_bf16_and_8bit_optimizer_state_when_it_dominates() -> None:
    b = _breakdown(parameters=4 * GiB, optimizer_state=8 * GiB)
    [bf16] = rules.bf16_optimizer_state(Facts(b))
    [eight] = rules.eight_bit_optimizer(Facts(b))
    assert bf16.saving_bytes == 4 * GiB and eight.saving_bytes == 6 * GiB
    small = _breakdown(parameters=8 * GiB, optimizer_state=GiB)
    assert rules.bf16_optimizer_state(Facts(small)) == [] and rules.eight_bit_optimizer(Facts(small)) == []


def test_zero_grad_set_to_none_when_gradients_are_alive() -> None:
    [s] = rules.zero_grad_set_to_none(Facts(_breakdown(parameters=4 * GiB, gradients=GiB)))
    assert s.saving_bytes == GiB
    assert rules.zero_grad_set_to_none(Facts(_breakdown(parameters=4 * GiB, gradients=MiB))) == []


def test_detach_kept_tensors_unless_a_leak_already_names_them() -> None:
    b = _breakdown(parameters=4 * GiB, graph_retained=GiB)
    [s] = rules.detach_kept_tensors(Facts(b))
    assert s.saving_bytes == GiB
    assert rules.detach_kept_tensors(Facts(b, findings=[_finding()])) == []
    assert rules.detach_kept_tensors(Facts(_breakdown(leak=_leak(), parameters=4 * GiB, graph_retained=GiB))) == []


def test_expandable_segments_for_fragmentation_or_a_large_cache_on_cuda() -> None:
    frag = _breakdown(verdict="fragmentation", largest=4 * MiB, reserved_unallocated=512 * MiB)
    [s] = rules.expandable_segments(Facts(frag))
    assert "largest free block (4.00 MiB)" in s.why
    assert rules.expandable_segments(Facts(frag, expandable_segments=True)) == []
    assert rules.expandable_segments(Facts(_breakdown(reserved_unallocated=4 * GiB))) != []  # 25% of the device
    assert rules.expandable_segments(Facts(_breakdown(reserved_unallocated=GiB))) == []  # 6%: not worth it
    assert rules.expandable_segments(Facts(_breakdown("cpu", reserved_unallocated=4 * GiB))) == []


def test_check_request_size_only_for_a_request_larger_than_the_device() -> None:
    b = _breakdown(verdict="request_exceeds_device", requested=100 * GiB)
    [s] = rules.check_request_size(Facts(b))
    assert s.saving_bytes == 100 * GiB and s.why.startswith("the working set does not fit. Look at")
    assert rules.check_request_size(Facts(_breakdown())) == []


# --- suggest: the order --------------------------------------------------------------------------


def test_a_leak_the_verdict_blames_comes_first_even_when_other_savings_are_larger() -> None:
    b = _breakdown(verdict="leak", leak=_leak(held=GiB), leaked=GiB, parameters=GiB, invisible=10 * GiB)
    kinds = _kinds(suggest(b))
    assert kinds[0] == "fix_leak" and "activation_checkpointing" in kinds
    not_blamed = _breakdown(leak=_leak(held=GiB), leaked=GiB, parameters=GiB, invisible=10 * GiB)
    assert _kinds(suggest(not_blamed))[0] == "activation_checkpointing"  # by saving when not the cause


def test_a_size_bug_stands_alone_but_for_the_leak_at_the_oom() -> None:
    b = _breakdown(verdict="request_exceeds_device", requested=100 * GiB, leak=_leak(), parameters=GiB,
                   invisible=10 * GiB)
    assert _kinds(suggest(b)) == ["check_request_size", "fix_leak"]
    assert _kinds(suggest(_breakdown(verdict="request_exceeds_device", requested=100 * GiB))) == ["check_request_size"]


@pytest.mark.parametrize("rule", rules.RULES, ids=lambda r: r.__name__)
def test_every_rule_is_quiet_on_an_empty_breakdown(rule: rules.Rule) -> None:
    assert rule(Facts(_breakdown())) == []
