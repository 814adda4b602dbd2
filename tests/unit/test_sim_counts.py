"""A simulated coordinator keeps, beside its counts, the few exceptions re-scores read
(``at_cap``, ``empty``, ``fed``); a woken recount updates them only for the counts
that moved. These tests hold them, after every count, to what the counts say, and the
broker's shared table of the backlogged queues in demand (which a tick's count copies)
to its queues."""

from __future__ import annotations

from modelfleet.sim import pull
from modelfleet.sim.engine import Simulation
from modelfleet.sim.pull_state import Coordinator
from modelfleet.sim.scenario import build_catalog, build_trace
from tests.sim_small import SMALL


class CountsCheck(pull.PullAffinity):
    """Pull-affinity that checks each coordinator's exceptions after every count."""

    def __init__(self, seed: int) -> None:
        super().__init__(rng_seed=seed)
        self.checked = 0
        self.recounts_moved = 0

    def _count(self, coord: Coordinator, full: bool) -> None:
        before = dict(coord.counts)
        super()._count(coord, full)
        if not full and coord.counts != before:
            self.recounts_moved += 1
        self._check(coord)

    def _check(self, coord: Coordinator) -> None:
        counts = coord.counts
        cap = {m for m, (_, consumers) in counts.items() if consumers >= self._cap[m]}
        empty = {m for m, (ready, _) in counts.items() if ready == 0}
        fed = {m for m, (ready, consumers) in counts.items() if ready > 0 and consumers > 0}
        assert coord.at_cap == cap
        assert coord.empty == empty
        assert coord.fed == fed
        # The broker's shared table of the backlogged in demand, against its queues.
        backlogged = {m: (len(self._queues[m]), len(self._consumers[m]))
                      for m in self._demand if self._queues[m]}
        assert self._backlog_in_demand == backlogged
        assert self._nonempty == {m for m, queue in enumerate(self._queues) if queue}
        self.checked += 1


def test_count_exceptions_follow_the_counts_after_every_count() -> None:
    router = CountsCheck(SMALL.seed)
    Simulation(SMALL, build_catalog(SMALL), build_trace(SMALL), router).run()
    assert router.checked > 1_000
    assert router.recounts_moved > 0  # woken recounts that moved some counts were checked
