"""Which starved cold queues a simulated coordinator gathers: the best few by rank.

``scheduling.snapshot_of`` keeps, per runtime, the ``slots`` best starved cold queues
(nothing consumes them, nothing of them is warm here) by scoring's own rank: priority,
then score, then model id. Under overload a worker sees thousands of them, and a
score's noise is a hash per (worker, model, noise window), so the simulator ranks only
those that can be among the best (``StarvedRanks.best``), with the same ranks.
"""

from __future__ import annotations

import heapq
import math
from bisect import insort
from collections.abc import Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field

from modelfleet.scheduling import QueueScorer, ScoringSettings, WorkerView

Rank = tuple[int, float, str, int]
"""snapshot_of's rank of a starved cold queue (lower first), then the model's index."""

# How far a bound must clear a rank's score to rule a queue out: rounding in the bound's
# sum and in log1p is below 1e-12 at these magnitudes (scores near starvation_score).
_MARGIN = 1e-9


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
        scorer = self.scorer
        assert scorer is not None
        priority = self.rank_priority
        amplitude = self.settings.noise_amplitude
        memo = self.memo
        # Those of a priority no worse than the slots-th best's: one of a lower priority
        # than slots others is never among the best (the same test as below, by sets).
        contenders: list[int] = []
        for members in self.levels:
            contenders.extend(starved & members)
            if len(contenders) >= slots:
                break
        # (priority, -backlog, model), taken off a heap in the order to rank them, a
        # group of equal priority and backlog after another: the ranking ends after a
        # few groups, so the thousands behind them are never put in order.
        order = [(priority[m], -counts[m][0], m) for m in contenders]
        heapq.heapify(order)
        # The best ``slots`` ranked so far, in order (ranks are unique: the model's index
        # ends each), kept as each is ranked rather than found again per group.
        best: list[Rank] = []
        while order:
            level, negative_backlog, _ = order[0]
            if len(best) >= slots:
                worst = best[-1]
                if level > worst[0] or scorer.starving_score(
                        -negative_backlog, amplitude) < -worst[1] - _MARGIN:
                    break  # level == worst[0] in the second test (ranked in order)
            while order and order[0][0] == level and order[0][1] == negative_backlog:
                key = (heapq.heappop(order)[2], -negative_backlog)
                rank = memo.get(key)
                if rank is None:
                    rank = memo[key] = self._rank(scorer, *key)
                if len(best) < slots:
                    insort(best, rank)
                elif rank < best[-1]:
                    best.pop()
                    insort(best, rank)
        return [rank[-1] for rank in best]

    def _rank(self, scorer: QueueScorer, model: int, backlog: int) -> Rank:
        """Its priority as ``snapshot_of`` ranks it, then ``QueueScorer.score`` of its
        view (no consumer, not held here: ``starving_score``, with the model's noise kept
        for the window), its id, its index."""
        name = self.names[model]
        noise = self.noise.get(model)
        if noise is None:
            noise = self.noise[model] = scorer.fresh_noise(name)
        return (self.rank_priority[model], -scorer.starving_score(backlog, noise), name,
                model)
