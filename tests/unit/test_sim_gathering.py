"""A woken re-score reuses its last gathering while nothing ``_gather`` reads has moved
(``PullGathering._gathering_stands``): the worker's version, the noise window, and the
demand's moves of the models whose place in the demand the gathering read. This test
holds that answer to the ground truth: whenever it says the gathering stands, gathering
again gives the same counts and moves nothing."""

from __future__ import annotations

from modelfleet.scheduling.scoring import COLD_WINDOW_S
from modelfleet.sim import pull
from modelfleet.sim.engine import Simulation
from modelfleet.sim.pull_state import Coordinator
from modelfleet.sim.scenario import build_catalog, build_trace
from tests.sim_small import SMALL


class GatheringCheck(pull.PullAffinity):
    """Pull-affinity that gathers again whenever its last gathering is said to stand."""

    def __init__(self, seed: int) -> None:
        super().__init__(rng_seed=seed)
        self.last_counted: dict[int, dict[int, tuple[int, int]]] = {}
        self.checked = 0
        self.stood_over_moves = 0  # ... with models in or out of the demand since

    def _gather(self, coord: Coordinator) -> dict[int, tuple[int, int]]:
        counted = super()._gather(coord)
        self.last_counted[coord.worker.index] = counted
        return counted

    def _gathering_stands(self, coord: Coordinator, window: int) -> bool:
        stands = super()._gathering_stands(coord, window)
        recent = coord.worker.recent_cold
        # (A cold subscription leaving the minute's window moves the version as _gather
        # drops it: the re-score gathers again for that, not for the answer checked here.)
        if stands and not (recent and self.sim.now - recent[0] >= COLD_WINDOW_S):
            assert coord.gathered is not None
            if coord.gathered[1] != self._demand_moves_end():
                self.stood_over_moves += 1
            version = coord.version
            gathered, looked_cold = set(coord.gathered_models), coord.gathered_cold
            assert super()._gather(coord) == self.last_counted[coord.worker.index]
            assert coord.version == version
            assert coord.gathered_models == gathered
            assert coord.gathered_cold == looked_cold
            self.checked += 1
        return stands


def test_a_gathering_said_to_stand_is_what_gathering_again_gives() -> None:
    router = GatheringCheck(SMALL.seed)
    Simulation(SMALL, build_catalog(SMALL), build_trace(SMALL), router).run()
    assert router.checked > 500
    assert router.stood_over_moves > 0  # stood while the demand moved: the finer test ran
