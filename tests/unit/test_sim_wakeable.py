"""``WakeableWorkers`` answers which wakeable workers folded past an announcement as a
walk over every one of them would."""

from __future__ import annotations

import random

from modelfleet.sim.wakeable import WakeableWorkers


def test_heard_after_is_every_wakeable_worker_folded_past_it_in_index_order() -> None:
    rng = random.Random(3)
    wakeable = WakeableWorkers()
    upto = {index: 0 for index in range(300)}  # every worker's heard_upto
    members: set[int] = set()
    for _ in range(5_000):
        index = rng.randrange(300)
        action = rng.random()
        if action < 0.35:
            wakeable.add(index, upto[index])
            members.add(index)
        elif action < 0.6:
            wakeable.discard(index)
            members.discard(index)
        else:  # a fold: heard_upto only grows, wakeable or not
            upto[index] += rng.randint(0, 50)
            wakeable.folded(index, upto[index])
        before = rng.randint(-1, max(upto.values()))
        assert wakeable.heard_after(before) == sorted(i for i in members if upto[i] > before)
        assert len(wakeable) == len(members) and set(wakeable) == members
        assert (index in wakeable) == (index in members)
