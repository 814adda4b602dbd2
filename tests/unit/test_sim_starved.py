"""``StarvedRanks.best`` ranks only the starved cold queues that can be among the best
few (it stops once no later group can beat them): these tests hold it to ranking every
one of them."""

from __future__ import annotations

import random

from modelfleet.scheduling import ScoringSettings
from modelfleet.sim.starved import StarvedRanks


def _ranks(models: int, seed: int) -> StarvedRanks:
    rng = random.Random(seed)
    priority = [-rng.choice((0, 0, 0, 1, 2)) for _ in range(models)]
    levels = [frozenset(m for m in range(models) if priority[m] == level)
              for level in sorted(set(priority))]
    names = tuple(f"model-{m:05d}" for m in range(models))
    return StarvedRanks("w0001", ScoringSettings(), seed, priority, names, levels)


def test_best_is_the_head_of_every_starved_queue_ranked() -> None:
    rng = random.Random(7)
    for seed in range(40):
        models = rng.choice((5, 50, 500))
        ranks = _ranks(models, seed)
        starved = set(rng.sample(range(models), rng.randint(1, models)))
        # Backlogs from a few values: many ties of priority and backlog, ranked by noise.
        counts = {m: (rng.choice((1, 1, 2, 3, 8, 40)), 0) for m in starved}
        slots = rng.randint(1, 6)
        now = rng.uniform(0.0, 100.0)
        found = ranks.best(starved, counts, slots, now)
        assert ranks.scorer is not None
        every = sorted(ranks._rank(ranks.scorer, m, counts[m][0]) for m in starved)
        assert found == [rank[-1] for rank in every[:slots]]


def test_best_holds_across_calls_in_a_window_as_backlogs_move_between_groups() -> None:
    # Ranks and noises are kept for the window: a queue ranked in a small group at one
    # call and in a large one (read off the window's noise order) at the next, or the
    # other way round, is ranked as if each call ranked every queue afresh.
    rng = random.Random(11)
    for seed in range(12):
        models = rng.choice((200, 2_000))
        ranks = _ranks(models, seed)
        now = rng.uniform(0.0, 100.0)
        for _ in range(25):
            starved = set(rng.sample(range(models), rng.randint(1, models)))
            # Groups of every size: all of backlog 1 (one large group decides), mostly 1
            # and 2 (two large ones), or a few larger ones ahead of them.
            spread = rng.choice(((1,), (1, 1, 2), (1, 1, 1, 1, 2, 3, 40)))
            counts = {m: (rng.choice(spread), 0) for m in starved}
            slots = rng.randint(1, 6)
            now += rng.uniform(0.0, 1.0)  # the same window, mostly; sometimes the next
            found = ranks.best(starved, counts, slots, now)
            assert ranks.scorer is not None
            every = sorted(ranks._rank(ranks.scorer, m, counts[m][0]) for m in starved)
            assert found == [rank[-1] for rank in every[:slots]]
