"""A tensor replaced each step by a larger one (``torch.cat`` onto a kept tensor): followed by family."""

from __future__ import annotations

import torch

from gpumemd.analysis.culprit_sentences import growth_sentence, rows_rate
from gpumemd.probes.survival.survivor_counts import SurvivorCounts
from gpumemd.probes.survival.survivors import SurvivorTracker
from gpumemd.probes.survival.tensor_families import RECORDS_TO_WATCH, TensorFamilies


def _described(*tensors: torch.Tensor) -> list[tuple[torch.Tensor, tuple]]:
    """The tensors with their group keys, as the tracker hands them to the families."""
    return SurvivorCounts(100).describe(list(tensors))


def test_the_largest_member_of_a_family_is_followed_across_shapes_and_watched_once_it_keeps_growing() -> None:
    families = TensorFamilies()
    key = ("cpu", "float32", (10,), False)
    for scan in range(RECORDS_TO_WATCH + 1):
        acc = torch.zeros(64 * (scan + 1), 10)
        seen = families.observe(_described(torch.zeros(32, 10), acc, torch.zeros(3, 4)), step=10 * scan)
        assert {f.key for f in seen} == {key, ("cpu", "float32", (4,), False)}
        family = families.get(key)
        assert family is not None and family.rows == 64 * (scan + 1) and family.row_bytes == 40
        assert families.sample(key) is acc
        assert family.watched == (scan >= RECORDS_TO_WATCH)
    assert family.describe() == "float32[N, 10]"
    assert list(family.past)[:2] == [(0, 64), (10, 128)]


def test_a_same_size_replacement_or_a_varying_batch_is_never_watched() -> None:
    families = TensorFamilies()
    sizes = [4, 48, 17, 33, 48, 5, 40, 48, 12, 48, 30] * 5
    for scan, b in enumerate(sizes):
        seen = families.observe(_described(torch.zeros(b, 16), torch.zeros(64, 10)), step=scan)
        assert len(seen) == 2 and not any(f.watched for f in seen)


def test_families_are_bounded_least_recently_seen_first() -> None:
    families = TensorFamilies(max_families=4)
    for width in range(10):
        families.observe(_described(torch.zeros(2, width + 1)), step=width)
    assert [width for width in range(1, 11) if families.get(("cpu", "float32", (width,), False))] == [7, 8, 9, 10]


def test_the_keys_a_scan_read_of_its_new_tensors_are_those_the_next_scan_counts_them_by() -> None:
    counts = SurvivorCounts(100)
    kept = [torch.zeros(3), torch.zeros(3)]
    counts.describe(kept)
    kept[0].resize_(5)  # read at the last scan, not again: the key it was listed with
    counts.count(list(kept), None)
    assert {g.key: g.count for g in counts.groups()} == {("cpu", "float32", (3,), False): 2}
    kept.append(torch.zeros(4))
    counts.count([kept[-1]], None)  # never described: read now
    assert {g.key: g.count for g in counts.groups()}[("cpu", "float32", (4,), False)] == 1
    del kept[-1]  # and uncounted when it dies
    assert ("cpu", "float32", (4,), False) not in {g.key for g in counts.groups()}


def test_the_tracker_lists_the_new_tensors_a_scan_saw() -> None:
    tracker = SurvivorTracker()
    tracker.install()
    try:
        tracker.scan()
        grown = torch.zeros(128, 10)
        tracker.scan()
        assert [key for t, key in tracker.new_tensors() if t is grown] == [("cpu", "float32", (128, 10), False)]
    finally:
        tracker.uninstall()


def test_the_sentence_names_the_holder_and_the_rate_in_rows_and_bytes() -> None:
    assert rows_rate(64.0, 40) == "+64 rows/step (~2.5 KiB/step)"
    text = growth_sentence("`all_logits` in evaluate() at eval.py:3", "float32[N, 10]", 64.0, 40, 19_200)
    assert text.startswith("`all_logits` in evaluate() at eval.py:3 grows +64 rows/step (~2.5 KiB/step): "
                           "float32[N, 10], 19,200 rows (750.0 KiB) now")
    assert "cat once" in text
    assert growth_sentence(None, "float32[N, 10]", 1.0, 40, 5).startswith("a float32[N, 10] tensor (holder not found)")
