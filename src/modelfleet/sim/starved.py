"""Which starved cold queues a simulated coordinator gathers: the best few by rank.

``scheduling.snapshot_of`` keeps, per runtime, the ``slots`` best starved cold queues
(nothing consumes them, nothing of them is warm here) by scoring's own rank: priority,
then score, then model id. Under overload a worker sees thousands of them, and a
score's noise is a hash per (worker, model, noise window), so the simulator ranks only
those that can be among the best (``StarvedRanks.best``), with the same ranks.
"""

from __future__ import annotations

import math
from bisect import insort
from collections.abc import Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from itertools import compress
from operator import itemgetter

from modelfleet.scheduling import QueueScorer, ScoringSettings, WorkerView

Rank = tuple[int, float, str, int]
"""snapshot_of's rank of a starved cold queue (lower first), then the model's index."""

# How far a bound must clear a rank's score to rule a queue out: rounding in the bound's
# sum and in log1p is below 1e-12 at these magnitudes (scores near starvation_score).
_MARGIN = 1e-9
# A group of equal priority and backlog this large is ranked from the window's noise
# order (StarvedRanks._best_of_group), not one rank at a time: under overload the
# backlog-1 starved are thousands per worker, ranked at every re-score.
_LARGE_GROUP = 32

_backlog = itemgetter(0)  # of a count (ready, consumers)


@dataclass(slots=True)
class StarvedRanks:
    """One worker's ranks of starved cold queues within one noise window, kept for it: a
    rank is a pure function of the window, the model and its backlog as last counted."""

    worker_id: str
    settings: ScoringSettings
    rng_seed: int
    rank_priority: Sequence[int]  # per model: snapshot_of's rank by priority (lower first)
    names: Sequence[str]  # per model: its id
    levels: Sequence[frozenset[int]]  # the models of each priority rank, best first
    bucket: int | None = None
    scorer: QueueScorer | None = None
    memo: dict[tuple[int, int], Rank] = field(default_factory=dict)
    noise: dict[int, float] = field(default_factory=dict)  # model -> its noise term
    # The models of ``noise`` by noise, most first (then id, index): a queue's place among
    # those of its group (equal priority and backlog), whose score grows with its noise.
    order: list[tuple[float, str, int]] = field(default_factory=list)
    unordered: list[tuple[float, str, int]] = field(default_factory=list)  # not in order yet

    def best(self, starved: AbstractSet[int], counts: Mapping[int, tuple[int, int]],
             slots: int, now: float) -> list[int]:
        """The ``slots`` best of ``starved`` (as last counted in ``counts``) by rank.

        Ranked in order of priority, then backlog (most first), a group of equal ones at
        a time; once ``slots`` are ranked, a group that cannot beat the worst of the
        best is the end: a lower priority, or a score that even the largest noise
        (``noise_amplitude``) leaves below it, as it does every later group's, for a
        score grows with the backlog and the noise. So each ranked queue's noise is
        drawn, and the others' are not; the best are those of ranking all."""
        bucket = math.floor(now / self.settings.noise_hold_s)
        if self.bucket != bucket:
            self.bucket = bucket
            self.scorer = QueueScorer(WorkerView(self.worker_id), self.settings, now,
                                      self.rng_seed)
            self.memo = {}
            self.noise = {}
            self.order = []
            self.unordered = []
        scorer = self.scorer
        assert scorer is not None
        amplitude = self.settings.noise_amplitude
        memo = self.memo
        # The best ``slots`` ranked so far, in order (ranks are unique: the model's index
        # ends each), kept as each is ranked rather than found again per group.
        best: list[Rank] = []
        # Priority levels best first; in each, groups of equal backlog, most first. The
        # groups are found with a pass over the level's backlogs each (C loops), not by
        # putting the thousands of starved queues in order: the ranking ends after a few.
        for members in self.levels:
            if len(best) >= slots:
                break  # a lower priority than slots ranked ones: never among the best
            level = list(starved & members)
            if not level:
                continue
            backlogs = list(map(_backlog, map(counts.__getitem__, level)))
            for backlog in sorted(set(backlogs), reverse=True):
                if len(best) >= slots and scorer.starving_score(
                        backlog, amplitude) < -best[-1][1] - _MARGIN:
                    break  # nor can any smaller backlog of this level, nor a later level
                group = list(compress(level, map(backlog.__eq__, backlogs)))
                if len(group) > _LARGE_GROUP:
                    # Only the group's own best ``slots`` can enter ``best``: the best of
                    # everything ranked is the best of each group's best.
                    group = self._best_of_group(scorer, group, backlog, slots)
                for model in group:
                    key = (model, backlog)
                    rank = memo.get(key)
                    if rank is None:
                        rank = memo[key] = self._rank(scorer, model, backlog)
                    if len(best) < slots:
                        insort(best, rank)
                    elif rank < best[-1]:
                        best.pop()
                        insort(best, rank)
        return [rank[-1] for rank in best]

    def _best_of_group(self, scorer: QueueScorer, group: list[int], backlog: int,
                       slots: int) -> list[int]:
        """The ``slots`` best of ``group`` (of one priority and one backlog) by rank,
        best first: read off the window's noise order, each member's noise drawn once a
        window. In a group a rank is its score (which only grows with the noise), then
        the id and index: so the members are taken in noise order until ``slots`` are
        held and the next one's score falls below the worst held; ties of score (two
        noises that round to one score) are taken too, and all are put in rank order."""
        noise = self.noise
        new = set(group).difference(noise)
        if new:
            names = self.names
            for model in new:
                name = names[model]
                drawn = noise[model] = scorer.fresh_noise(name)
                self.unordered.append((-drawn, name, model))
        if self.unordered:
            self.order += self.unordered
            self.order.sort()  # mostly sorted already: a merge of the new run
            self.unordered = []
        members = set(group)
        taken: list[Rank] = []
        worst = math.inf  # the lowest score among the ``slots`` best taken so far
        memo = self.memo
        for negative, _, model in self.order:
            if model not in members:
                continue
            if len(taken) >= slots and scorer.starving_score(backlog, -negative) < worst:
                break
            key = (model, backlog)
            rank = memo.get(key)
            if rank is None:
                rank = memo[key] = self._rank(scorer, model, backlog)
            taken.append(rank)
            if len(taken) <= slots:
                worst = min(worst, -rank[1])
        taken.sort()
        return [rank[-1] for rank in taken[:slots]]

    def _rank(self, scorer: QueueScorer, model: int, backlog: int) -> Rank:
        """Its priority as ``snapshot_of`` ranks it, then ``QueueScorer.score`` of its
        view (no consumer, not held here: ``starving_score``, with the model's noise kept
        for the window), its id, its index."""
        name = self.names[model]
        noise = self.noise.get(model)
        if noise is None:
            noise = self.noise[model] = scorer.fresh_noise(name)
            self.unordered.append((-noise, name, model))
        return (self.rank_priority[model], -scorer.starving_score(backlog, noise), name,
                model)
