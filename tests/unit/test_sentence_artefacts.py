"""Sentences without artefacts: no negative or None step, no "~0 min", a suspended frame's local by name."""

from __future__ import annotations

from gpumemd.analysis.leak_headline import duration_words, projection_words, since_words
from gpumemd.report.view import groups_note, totals_sentence


def test_under_a_minute_is_said_in_seconds() -> None:
    assert duration_words(40 / 3600) == "40 s"
    assert duration_words(0.1 / 3600) == "1 s"  # never "0 s" for an OOM still ahead
    assert duration_words(12 / 60) == "12 min"
    assert projection_words(150, 30 / 3600) == ("~30 s (~150 steps)", "~30 s")


def test_a_leak_present_from_the_start_says_so_with_the_first_watched_step() -> None:
    assert since_words(-2) == "since step 0, the first watched"
    assert since_words(0) == "since step 0, the first watched"
    assert since_words(1200) == "since step 1,200"


def test_a_census_before_the_first_step_ended_says_so() -> None:
    tensors = {"tensor_count": 2, "total_bytes": 4096, "step": None}
    note = groups_note(tensors, [], 10)
    assert "before the first step ended" in note and "None" not in note
    assert "after step 7" in groups_note({**tensors, "step": 7}, [], 10)


def test_an_earlier_census_shown_for_a_failed_one_says_which_and_why() -> None:
    # The census at a CPU OOM under ulimit -v failed (MemoryError); the last one, 1,256 steps before,
    # was shown as "census at the OOM".
    tensors = {"tensor_count": 623, "total_bytes": 1_292_552_276, "step": 611,
               "note": "census at the OOM failed (MemoryError)"}
    assert groups_note(tensors, [], 10) == ("623 tensors in 0 groups, 1.20 GiB (the last census, after step 611: "
                                            "census at the OOM failed (MemoryError)).")


def test_the_breakdown_line_says_only_the_figures_the_report_has() -> None:
    # A CPU OOM has no allocator: its HTML said "largest free block -" (markdown: "allocated -;
    # reserved -; largest free block -").
    cpu = {"breakdown": {"device": "cpu", "total_bytes": 6 * 2**30, "requested_bytes": 4 * 2**20},
           "peak_bytes": 5 * 2**30}
    line = totals_sentence(cpu)
    assert line.endswith("; requested 4.00 MiB; peak seen 5.00 GiB.") and " -" not in line, line
    cuda = {"breakdown": {"device": "cuda:0", "total_bytes": 80 * 2**30, "requested_bytes": 2**30,
                          "allocated_bytes": 70 * 2**30, "reserved_bytes": 79 * 2**30,
                          "largest_free_block_bytes": 2**20}, "peak_bytes": 79 * 2**30}
    assert totals_sentence(cuda) == ("Device total: 80.00 GiB; requested 1.00 GiB; allocated 70.00 GiB; reserved "
                                     "79.00 GiB; largest free block 1.00 MiB; peak seen 79.00 GiB.")
