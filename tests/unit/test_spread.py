"""Placement by memory and load, replicas for hot models, one budget split among runtimes.

The decisions of ``worker/spread.py`` (pure); ``worker/pool.py`` carries them out with
the runtimes' ``set_budgets`` and ``budget`` ops (tests/unit/test_worker_spread.py).
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from modelfleet.worker.spread import Change, RuntimeView, Spread, size_table, split_budget

MB = 1024 * 1024
POOL = 176 * MB


def two(a: RuntimeView | None = None, b: RuntimeView | None = None) -> list[RuntimeView]:
    return [a or RuntimeView("runtime-0"), b or RuntimeView("runtime-1")]


def test_a_model_goes_where_it_is_already_resident() -> None:
    spread = Spread(replica_at=4, keep_s=10, size_of=size_table({}))
    views = two(RuntimeView("runtime-0", used_bytes=10 * MB),
                RuntimeView("runtime-1", used_bytes=80 * MB, resident=frozenset({"m"})))
    # runtime-1 holds more and so has less free share, but m is resident there.
    assert spread.home("m", views, POOL) == "runtime-1"


def test_a_new_model_goes_to_the_least_loaded_runtime_then_the_most_free_share() -> None:
    spread = Spread(replica_at=4, keep_s=10, size_of=size_table({}))
    views = two(RuntimeView("runtime-0", used_bytes=10 * MB),
                RuntimeView("runtime-1", used_bytes=80 * MB))
    assert spread.home("a", views, POOL) == "runtime-0"  # idle both: more free share
    for _ in range(3):
        spread.started("a", "runtime-0")
    assert spread.home("b", views, POOL) == "runtime-1"  # runtime-0 is busy now


def test_a_model_stays_on_its_runtime_while_it_is_held() -> None:
    spread = Spread(replica_at=4, keep_s=10, size_of=size_table({}))
    assert spread.home("a", two(), POOL) == "runtime-0"
    spread.started("b", "runtime-0")
    assert spread.home("a", two(), POOL) == "runtime-0"  # placed once, not per call
    assert spread.route("a", two(), POOL) == "runtime-0"


def test_a_load_refused_for_memory_moves_the_model_to_another_runtime() -> None:
    spread = Spread(replica_at=4, keep_s=10, size_of=size_table({}))
    assert spread.home("a", two(), POOL) == "runtime-0"
    assert spread.rehome("a", "runtime-0", two(), POOL) == "runtime-1"
    assert spread.holders("a") == ("runtime-1",)  # its next tasks go there too
    assert spread.route("a", two(), POOL) == "runtime-1"


def test_a_refused_model_goes_to_a_holder_it_has_already_and_nowhere_when_alone() -> None:
    spread = Spread(replica_at=1, keep_s=10, size_of=size_table({}))
    three = [RuntimeView(f"runtime-{i}", resident=frozenset({"a"}) if i == 0 else frozenset())
             for i in range(3)]
    assert spread.home("a", three, POOL) == "runtime-0"
    spread.started("a", "runtime-0")
    spread.started("b", "runtime-1")  # busy: the replica goes to runtime-2
    assert spread.review("a", three, POOL, now=0) == Change("add", "a", "runtime-2")
    assert spread.rehome("a", "runtime-0", three, POOL) == "runtime-2"  # a holder already
    assert spread.holders("a") == ("runtime-2",)
    down = two(b=RuntimeView("runtime-1", up=False))
    spread.home("b", down, POOL)
    assert spread.rehome("b", "runtime-0", down, POOL) is None  # no other runtime up
    assert spread.holders("b") == ("runtime-0",)


def on(*names: str, model: str = "hot", **extra: int) -> list[RuntimeView]:
    """Both runtimes, with ``model`` resident on ``names``."""
    return [RuntimeView(f"runtime-{i}", resident=frozenset({model})
                        if f"runtime-{i}" in names else frozenset(),
                        **extra if i == 1 else {}) for i in (0, 1)]


def test_tasks_never_go_to_a_runtime_that_is_down_when_another_holds_the_model() -> None:
    spread = Spread(replica_at=1, keep_s=10, size_of=size_table({}))
    spread.home("m", two(), POOL)
    spread.started("m", "runtime-0")
    assert spread.review("m", on("runtime-0", model="m"), POOL, 0.0) == \
        Change("add", "m", "runtime-1")
    down = two(RuntimeView("runtime-0", up=False))
    assert spread.route("m", down, POOL) == "runtime-1"


def test_new_models_are_spread_by_what_is_placed_before_it_is_resident() -> None:
    """Placed in one go (a worker's first re-score): the second goes beside, not on top."""
    spread = Spread(replica_at=4, keep_s=10, size_of=size_table({"a": 30 * MB, "b": 30 * MB}))
    assert spread.home("a", two(), POOL) == "runtime-0"
    assert spread.home("b", two(), POOL) == "runtime-1"


def test_a_hot_model_gets_a_second_runtime_and_tasks_go_to_the_least_loaded() -> None:
    spread = Spread(replica_at=4, keep_s=10, size_of=size_table({"hot": 20 * MB}))
    views = on("runtime-0")
    for _ in range(3):
        runtime = spread.route("hot", views, POOL)
        spread.started("hot", runtime)
        assert spread.review("hot", views, POOL, 0.0) is None  # not yet hot
    assert runtime == "runtime-0"
    spread.started("hot", spread.route("hot", views, POOL))
    assert spread.review("hot", views, POOL, 0.0) == Change("add", "hot", "runtime-1")
    assert spread.holders("hot") == ("runtime-0", "runtime-1")
    # The next tasks go to the replica until both carry as much.
    routed = []
    for _ in range(4):
        routed.append(spread.route("hot", views, POOL))
        spread.started("hot", routed[-1])
    assert routed == ["runtime-1"] * 4
    assert spread.route("hot", views, POOL) == "runtime-0"  # level: home first


def test_tasks_waiting_for_the_first_load_do_not_make_a_model_hot() -> None:
    spread = Spread(replica_at=2, keep_s=10, size_of=size_table({}))
    spread.home("hot", two(), POOL)
    for _ in range(8):
        spread.started("hot", "runtime-0")
    assert spread.review("hot", two(), POOL, 0.0) is None  # still loading on runtime-0
    assert spread.review("hot", on("runtime-0"), POOL, 0.0) == Change("add", "hot", "runtime-1")


def test_no_replica_when_the_other_runtime_is_busy_or_memory_does_not_allow() -> None:
    spread = Spread(replica_at=2, keep_s=10,
                    size_of=size_table({"hot": 20 * MB, "other": 20 * MB}))
    spread.home("hot", two(), POOL)
    for _ in range(2):
        spread.started("hot", "runtime-0")
    for _ in range(2):
        spread.started("other", "runtime-1")  # runtime-1 has no free slot
    assert spread.review("hot", on("runtime-0"), POOL, 0.0) is None
    spread.finished("other", "runtime-1")
    # 20 MB more beside 150 MB pinned and 2 busy copies of 20 MB: more than 176 MB.
    assert spread.review("hot", on("runtime-0", pinned_bytes=150 * MB), POOL, 0.0) is None
    assert spread.review("hot", on("runtime-0"), POOL, 0.0) == Change("add", "hot", "runtime-1")


def test_the_replica_is_dropped_once_demand_stayed_low_for_keep_s() -> None:
    spread = Spread(replica_at=4, keep_s=10, size_of=size_table({"hot": MB}))
    both = on("runtime-0", "runtime-1")
    spread.home("hot", two(), POOL)
    for _ in range(4):
        spread.started("hot", "runtime-0")
    assert spread.review("hot", both, POOL, 0.0) == Change("add", "hot", "runtime-1")
    for _ in range(2):  # 2 left: half of one runtime's 4, the line to drop below
        spread.finished("hot", "runtime-0")
    assert spread.review("hot", both, POOL, 100.0) is None  # quiet since 100
    assert spread.review("hot", both, POOL, 109.0) is None
    spread.started("hot", "runtime-0")  # 3: between the lines, the clock starts again
    assert spread.review("hot", both, POOL, 111.0) is None
    spread.finished("hot", "runtime-0")
    assert spread.review("hot", both, POOL, 112.0) is None
    assert spread.review("hot", both, POOL, 122.0) == Change("drop", "hot", "runtime-1")
    assert spread.holders("hot") == ("runtime-0",)


def test_sweep_drops_cooled_replicas_and_forgets_models_held_nowhere() -> None:
    spread = Spread(replica_at=1, keep_s=0, size_of=size_table({}))
    spread.home("hot", two(), POOL)
    spread.home("gone", two(), POOL)
    spread.started("hot", "runtime-0")
    both = on("runtime-0", "runtime-1")
    assert spread.review("hot", both, POOL, 0.0) == Change("add", "hot", "runtime-1")
    spread.finished("hot", "runtime-0")
    assert spread.sweep(both, POOL, 1.0) == [Change("drop", "hot", "runtime-1")]
    assert spread.holders("hot") == ("runtime-0",)
    assert spread.holders("gone") == ()  # not resident, nothing running: placed afresh


def test_a_replica_threshold_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="replica_at"):
        Spread(replica_at=0, keep_s=1, size_of=size_table({}))


# -- one budget for the pool ---------------------------------------------------------------

def test_the_free_bytes_go_as_one_block_to_the_runtime_about_to_load() -> None:
    views = two(RuntimeView("runtime-0", budget_bytes=88 * MB, used_bytes=60 * MB),
                RuntimeView("runtime-1", budget_bytes=88 * MB, used_bytes=40 * MB))
    budgets = split_budget(POOL, views, grow="runtime-1", need_bytes=36 * MB)
    assert budgets == {"runtime-0": 60 * MB, "runtime-1": 116 * MB}
    assert sum(budgets.values()) == POOL


def test_a_miss_bigger_than_the_free_block_takes_bytes_from_the_fuller_runtime() -> None:
    views = two(RuntimeView("runtime-0", used_bytes=100 * MB, pinned_bytes=30 * MB),
                RuntimeView("runtime-1", used_bytes=66 * MB))
    budgets = split_budget(POOL, views, grow="runtime-1", need_bytes=36 * MB)
    assert budgets == {"runtime-0": 74 * MB, "runtime-1": 102 * MB}  # 10 free + 26 given
    # Never below what is pinned: the rest the loading runtime evicts of its own.
    budgets = split_budget(POOL, views, grow="runtime-1", need_bytes=150 * MB)
    assert budgets == {"runtime-0": 30 * MB, "runtime-1": 146 * MB}


def test_without_a_miss_the_free_block_stays_where_it_is() -> None:
    views = two(RuntimeView("runtime-0", budget_bytes=50 * MB, used_bytes=50 * MB),
                RuntimeView("runtime-1", budget_bytes=126 * MB, used_bytes=40 * MB))
    assert split_budget(POOL, views) == {"runtime-0": 50 * MB, "runtime-1": 126 * MB}


def test_runtimes_holding_more_than_the_pool_are_brought_back_within_it() -> None:
    """A runtime restarted with its starting share beside one that holds the rest."""
    views = two(RuntimeView("runtime-0", budget_bytes=150 * MB, used_bytes=150 * MB),
                RuntimeView("runtime-1", budget_bytes=88 * MB, used_bytes=40 * MB))
    # 14 MB over: the runtime holding most gives them back (it evicts down to 136 MB).
    assert split_budget(POOL, views) == {"runtime-0": 136 * MB, "runtime-1": 40 * MB}


held = st.builds(lambda used, reserved, pinned: (used, reserved, min(pinned, used)),
                 st.integers(0, 200), st.integers(0, 50), st.integers(0, 200))


@given(st.lists(held, min_size=1, max_size=4), st.integers(0, 3), st.integers(0, 300),
       st.integers(1, 400))
def test_the_split_sums_to_the_pool_and_never_exceeds_it(
        runtimes: list[tuple[int, int, int]], grow: int, need: int, pool: int) -> None:
    views = [RuntimeView(f"r{i}", used_bytes=u, reserved_bytes=r, pinned_bytes=p)
             for i, (u, r, p) in enumerate(runtimes)]
    budgets = split_budget(pool, views, grow=f"r{grow}", need_bytes=need)
    floors = sum(v.floor_bytes for v in views)
    assert all(budgets[v.name] >= v.floor_bytes for v in views)
    if floors <= pool:
        assert sum(budgets.values()) == pool
    else:  # only what cannot be taken back exceeds it, and nothing more
        assert sum(budgets.values()) == floors
