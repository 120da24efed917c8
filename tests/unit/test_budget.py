"""The one overhead budget: its parts' shares add up to the whole, and the census takes what is left."""

from __future__ import annotations

import pytest

from gpumemd import budget
from gpumemd.budget import Part

B = 0.01  # the default overhead_budget


def test_the_clocked_plan_leaves_the_unclocked_share_of_the_budget() -> None:
    assert budget.clocked_plan(B) == pytest.approx(B * (1 - budget.UNCLOCKED_SHARE))
    assert sum(budget.share(B, part) for part in Part) == pytest.approx(budget.clocked_plan(B))


def test_the_census_takes_the_plan_less_what_the_other_parts_took() -> None:
    plan = budget.clocked_plan(B)
    assert budget.census_share(B, 0.0) == pytest.approx(plan)
    assert budget.census_share(B, 0.3 * plan) == pytest.approx(0.7 * plan)
    assert budget.census_share(B, -1.0) == pytest.approx(plan)  # a clock that went back gives nothing extra


def test_parts_inside_their_shares_keep_the_clocked_total_inside_the_plan() -> None:
    # Each other part at its full share: the census is left exactly its own share, and the whole is the plan.
    others = sum(budget.share(B, part) for part in Part if part is not Part.CENSUS)
    census = budget.census_share(B, others)
    assert census == pytest.approx(budget.share(B, Part.CENSUS))
    assert others + census == pytest.approx(budget.clocked_plan(B))
    # Any mix of the other parts inside their shares: the total never passes the plan.
    for fraction in (0.0, 0.25, 0.5, 0.9, 1.0):
        used = fraction * others
        assert used + budget.census_share(B, used) <= budget.clocked_plan(B) + 1e-12


def test_parts_over_their_shares_squeeze_the_census_to_its_own_share_not_below() -> None:
    assert budget.census_share(B, budget.clocked_plan(B) * 2) == pytest.approx(budget.share(B, Part.CENSUS))


def test_steps_between_spaces_work_to_its_share_of_the_step_time() -> None:
    # 0.1 s of work at 0.5% of 1 s steps: every 20 steps; cheaper than its share: every step.
    assert budget.steps_between(0.1, 0.005, 1.0) == 20
    assert budget.steps_between(0.1, 0.005, 0.999) == 21
    assert budget.steps_between(1e-6, 0.005, 1.0) == 1


@pytest.mark.parametrize(("allowed", "step"), [(0.0, 1.0), (0.01, 0.0), (-0.01, 1.0)])
def test_steps_between_refuses_a_share_or_step_that_is_not_positive(allowed: float, step: float) -> None:
    with pytest.raises(ValueError, match="must be positive"):
        budget.steps_between(0.1, allowed, step)
