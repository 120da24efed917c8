"""The line a person reads at a state change, and where a count series' leak began."""

from __future__ import annotations

import dataclasses

from gpumemd.analysis.culprit_sentences import chain_sentence
from gpumemd.analysis.leak_headline import (
    HEADLINE_MAX,
    Facts,
    cut_middle,
    fit_holder,
    headline,
    holder_words,
    mention,
    short_path,
    withdrawn_line,
)
from gpumemd.analysis.leak_track import hinge_onset, knee_between
from gpumemd.components.leak_culprits import CHAIN_NODES_MAX
from gpumemd.records.findings import Culprit, Finding


def test_headline_says_kind_rate_holder_onset_and_time_to_oom() -> None:
    line = headline(Facts(kind="tensor_leak", state="confirmed", rate="+1 tensor/step (~2.0 KiB/step)",
                          holder="held by `kept` in main() at train.py:12", onset_step=300, out_of_memory="~1.3 h"))
    assert line == ("tensor leak confirmed: +1 tensor/step (~2.0 KiB/step) held by `kept` in main() at train.py:12, "
                    "since step 300, out of memory in ~1.3 h")


def test_a_long_holder_loses_its_location_then_its_middle_never_its_root() -> None:
    root = "`kept_predictions` in train_epoch()"
    holder = f"held by {root} at some/deep/package/path/train.py:1234 → " + " → ".join(f"hop{i}" for i in range(30))
    facts = Facts(kind="graph_leak", state="suspected", rate="+1 autograd node/step (~32.1 KiB/step)",
                  holder=holder, onset_step=301, out_of_memory="~8 min")
    line = "gpumemd: " + headline(facts)
    assert len(line) <= HEADLINE_MAX
    assert root in line and "train.py:1234" not in line and line.endswith(", since step 301, out of memory in ~8 min")
    assert "…" in line and "hop29" in line


def test_a_long_holder_keeps_the_line_that_adds_to_it() -> None:
    holder = ("held by `kept` in epoch() at some/deep/package/path/train.py:1234, appended at path/train.py:1240 → "
              + " → ".join(f"hop{i}" for i in range(30)))
    facts = Facts(kind="graph_leak", state="suspected", rate="+1 autograd node/step (~32.1 KiB/step)",
                  holder=holder, onset_step=301, out_of_memory="~8 min")
    line = "gpumemd: " + headline(facts)
    assert len(line) <= HEADLINE_MAX
    # where it lives goes first (the function says where), then the directories of the line the
    # user changes, then the middle of the path: that line stays
    assert "train.py:1234" not in line
    assert "held by `kept` in epoch(), appended at train.py:1240 → … → hop28 → hop29, since step 301" in line
    # a root too long for the width says that line shorter (it is in the root's own file), then not
    # at all (the summary keeps it): never the name and its function
    root = "held by `kept` in epoch(), appended at train.py:1240"
    assert fit_holder(holder, len(root) + 4) == root + " → …"
    assert fit_holder(holder, len(root)) == "held by `kept` in epoch(), appended at line 1240 → …"
    assert fit_holder(holder, 36).startswith("held by `kept` in epoch()") and "1240" not in fit_holder(holder, 36)


def test_sizes_stay_out_of_the_line_and_the_exit_mention() -> None:
    assert short_path("`kept` in main() at train.py:12 → list of 1,204 items") == "`kept` in main() at train.py:12"
    assert short_path("trainer.stats.window (deque of 512)") == "trainer.stats.window (deque)"
    # a cut path's note of itself stays in the summary and the report's table, not in a sentence
    assert short_path("`x` in train() at train.py:13, a finished frame (path cut at depth 6)") == \
        "`x` in train() at train.py:13"
    assert short_path("TrainerState.history → list of 2 items (path cut at depth 3)") == "TrainerState.history"
    assert (holder_words((Culprit("float32[]", 1, 4, holder="the autograd graph (3,001 nodes) of float32[], held by "
                                                            "`losses`"),), ())
            == "kept alive by the autograd graph of float32[], held by `losses`")
    culprit = Culprit("float32[4]", 10, 160, holder="Cache.items → dict of 711 items")
    finding = Finding(kind="tensor_leak", series="tensors{group=x}", state="confirmed", slope_bytes_per_step=16.0,
                      slope_low=16.0, slope_high=16.0, onset_step=60, growth_bytes=160, steps_to_oom=None,
                      first_step=100, updated_step=700, summary="...", culprits=(culprit,))
    assert mention(finding) == "tensor leak held by Cache.items (confirmed, since step 60)"


def test_a_sparse_count_is_dated_between_its_scans() -> None:
    # one point per scan, 50 steps apart; one tensor kept per step from step 300 on, counted at
    # the scan's step: the hinge lands on the scan two steps into the leak
    xs = [float(x) for x in range(2, 703, 50)]
    ys = [max(0.0, x - 300) for x in xs]
    i = hinge_onset(xs, ys)
    assert xs[i] == 302
    assert knee_between(xs, ys, i) == 300
    # three tensors per step from step 287, a stray survivor on the flat part
    ys = [3 * max(0.0, x - 287) for x in xs]
    ys[2] = 1.0
    assert knee_between(xs, ys, hinge_onset(xs, ys)) == 287


def test_a_cut_path_keeps_whole_hops_never_half_a_word() -> None:
    path = "`errors` in <module>() → list → [i].__traceback__ → frame train_step() → local `act`"
    assert cut_middle(path, 70) == "`errors` in <module>() → … → frame train_step() → local `act`"
    assert cut_middle(path, 45) == "`errors` in <module>() → … → local `act`"
    assert cut_middle(path, len(path)) == path


def test_one_cause_of_several_groups_is_named_once_by_the_path_they_share() -> None:
    root = "`errors` in main() at train.py:4 → list of 595 items → [i].__traceback__ → frame step()"
    culprits = tuple(Culprit(group, 1, 8, holder=f"{root} → local `{name}`")
                     for group, name in (("float32[32, 256]", "act"), ("float32[32, 64]", "x")))
    finding = Finding(kind="tensor_leak", series="tensors{group=x}", state="confirmed", slope_bytes_per_step=16.0,
                      slope_low=16.0, slope_high=16.0, onset_step=79, growth_bytes=160, steps_to_oom=None,
                      first_step=100, updated_step=700, summary="...", culprits=culprits)
    said = mention(finding)
    assert said.startswith("tensor leak held by `errors` in main()") and said.endswith("(confirmed, since step 79)")
    assert "frame step()" in said and "local `act`" not in said and "local `x`" not in said


def test_a_chain_counted_to_its_bound_says_so() -> None:
    exact = chain_sentence("float32[]", 3_001, 0.0, "`epoch_loss` in train() at train.py:57")
    assert "(graph of 3,001 nodes now; backward() freed their saved tensors" in exact
    bounded = chain_sentence("float32[]", CHAIN_NODES_MAX, 0.0, None, at_least=True)
    assert "(holder not found) (graph of 20,000+ nodes now;" in bounded


def test_a_withdrawn_finding_says_what_accounts_for_its_growth() -> None:
    host = Finding(kind="host_leak", series="host_rss_bytes", state="suspected", slope_bytes_per_step=36e3,
                   slope_low=3e4, slope_high=4e4, onset_step=982, growth_bytes=10**7, steps_to_oom=1e4, first_step=1352,
                   updated_step=1352, summary="", headline="host memory leak suspected: +36.1 KiB/step")
    holder = "`val_preds` in <module>() at proj/train.py:5, appended at proj/train.py:13 → list of 400 items"
    kept = Finding(kind="tensor_leak", series="tensors{device=cpu,group=float32[64]}", state="confirmed",
                   slope_bytes_per_step=256.0, slope_low=250.0, slope_high=260.0, onset_step=1000, growth_bytes=10**5,
                   steps_to_oom=1e8, first_step=1405, updated_step=1505, summary="", headline="",
                   culprits=(Culprit(description="float32[64]", count_delta=400, bytes_delta=10**5, holder=holder),))

    line = withdrawn_line(host, kept)
    assert line == ("host memory leak suspected since step 982 withdrawn: the tensor leak held by `val_preds` in "
                    "<module>() at proj/train.py:5, appended at proj/train.py:13 accounts for its growth, "
                    "+35.2 KiB/step")
    assert len(line) <= HEADLINE_MAX
    assert withdrawn_line(host, None) == ("host memory leak suspected since step 982 withdrawn: the growth of the "
                                          "tensors the agent counts accounts for its growth, +35.2 KiB/step")

    deep = dataclasses.replace(kept, culprits=(Culprit(description="float32[64]", count_delta=400, bytes_delta=10**5,
                                                       holder="`predictions_of_every_validation_step` in "
                                                              "a_long_function_name() at a/deep/path/to/train.py:1234 "
                                                              "→ " + " → ".join(f"hop{i}" for i in range(20))),))
    long_line = withdrawn_line(dataclasses.replace(host, onset_step=1_234_567), deep)
    assert len(long_line) <= HEADLINE_MAX and "`predictions_of_every_validation_step`" in long_line, long_line
