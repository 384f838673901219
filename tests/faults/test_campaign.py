"""A short fault campaign (``campaign.py``) with a fixed seed: every invariant holds on every
run. A failure prints each violating run's seed; ``python -m tests.faults.campaign --replay
SEED`` runs it alone."""

from __future__ import annotations

import pytest

from tests.faults import campaign

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]

SEED = 1
RUNS = 12


def test_a_short_campaign_breaks_no_invariant() -> None:
    outcomes = campaign.campaign(campaign.seeds_of(SEED, RUNS))
    print(campaign.summary(outcomes))
    kinds = {o.fault.kind for o in outcomes}
    assert len(kinds) >= 4, kinds  # not vacuous: the draw spreads over the kinds
    broken = [campaign.line(o) + f" {o.violations}" for o in outcomes if o.violations]
    assert not broken, "\n".join(broken)
