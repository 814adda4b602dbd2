"""The version route and the worker's rolling plan (pure)."""

from __future__ import annotations

from modelfleet.control import Holdings, ModelView, plan, route


def held(worker: str, versions: set[str], failed: set[str] | None = None) -> Holdings:
    return Holdings(worker, {"m": frozenset(versions)}, {"m": frozenset(failed or set())})


def test_with_no_worker_holding_it_the_route_is_the_newest_version() -> None:
    assert route("m", ["1", "2"], None, []) == "2"


def test_a_new_version_takes_the_route_only_once_warm_wherever_the_old_one_is() -> None:
    versions = ["1", "2"]
    assert route("m", versions, None, [held("a", {"1"}), held("b", {"1"})]) == "1"
    assert route("m", versions, None, [held("a", {"1", "2"}), held("b", {"1"})]) == "1"
    assert route("m", versions, None, [held("a", {"1", "2"}), held("b", {"1", "2"})]) == "2"
    assert route("m", versions, None, [held("a", {"2"}), held("b", {"1", "2"})]) == "2"


def test_a_version_that_failed_to_load_anywhere_never_takes_the_route() -> None:
    fleet = [held("a", {"1"}, failed={"2"}), held("b", {"1", "2"})]
    assert route("m", ["1", "2"], None, fleet) == "1"
    assert route("m", ["1", "2"], None, [held("a", set(), failed={"2"})]) == "1"


def test_every_version_failed_the_newest_routes_and_answers_its_error() -> None:
    assert route("m", ["1", "2"], None, [held("a", set(), failed={"1", "2"})]) == "2"


def test_an_operators_named_version_wins() -> None:
    assert route("m", ["1", "2"], "1", [held("a", {"2"})]) == "1"
    assert route("m", ["1", "2"], "9", [held("a", {"2"})]) == "2"  # gone from the repository


def test_holders_with_no_shared_version_route_to_the_newest_held_anywhere() -> None:
    assert route("m", ["1", "2", "3"], None, [held("a", {"1"}), held("b", {"2"})]) == "2"


def view(**overrides: object) -> ModelView:
    fields: dict[str, object] = dict(
        model_id="m", versions=("1", "2"), route="1", loaded=True, pinned=False,
        explicit=None, resident=frozenset({"1"}), pinned_here=frozenset(),
        loading=frozenset(), failed=frozenset(), superseded_s={})
    fields.update(overrides)
    return ModelView(**fields)  # type: ignore[arg-type]


def test_a_worker_holding_the_old_version_warms_the_new_one() -> None:
    decided = plan([view()], drain_s=10)
    assert [(w.model_id, w.version) for w in decided.warm] == [("m", "2")]
    assert not decided.release and not decided.unpin


def test_a_worker_not_holding_the_model_warms_nothing() -> None:
    assert plan([view(resident=frozenset())], drain_s=10).warm == ()


def test_no_second_load_of_a_version_loading_or_failed_here() -> None:
    assert plan([view(loading=frozenset({"2"}))], drain_s=10).warm == ()
    assert plan([view(failed=frozenset({"2"}))], drain_s=10).warm == ()


def test_the_old_version_drains_then_is_released() -> None:
    moved = dict(route="2", resident=frozenset({"1", "2"}))
    assert plan([view(**moved, superseded_s={"1": 3.0})], drain_s=10).release == ()
    assert plan([view(**moved, superseded_s={"1": 10.0})], drain_s=10).release == (("m", "1"),)


def test_a_version_that_never_was_the_route_here_is_left_to_eviction() -> None:
    decided = plan([view(route="2", resident=frozenset({"1", "2"}))], drain_s=0)
    assert decided.release == ()


def test_a_pinned_old_version_is_unpinned_as_soon_as_the_route_left_it() -> None:
    decided = plan([view(route="2", pinned=True, resident=frozenset({"1", "2"}),
                         pinned_here=frozenset({"1", "2"}), superseded_s={"1": 0.5})],
                   drain_s=10)
    assert decided.unpin == (("m", "1"),) and decided.release == ()
    assert decided.warm == ()  # pinned versions are the PinKeeper's to load


def test_an_operators_unpin_unpins_every_resident_version() -> None:
    decided = plan([view(pinned=False, pinned_here=frozenset({"1"}))], drain_s=10)
    assert decided.unpin == (("m", "1"),)


def test_an_unloaded_model_still_resident_is_dropped() -> None:
    assert plan([view(loaded=False)], drain_s=10).unload == ("m",)
    assert plan([view(loaded=False, resident=frozenset())], drain_s=10).unload == ()


def test_a_route_just_given_sticks_while_no_worker_is_known_to_hold_the_model() -> None:
    # A request has just loaded version 1; no announcement says so yet; version 2 appears.
    assert route("m", ["1", "2"], None, [], sticky="1") == "1"
    assert route("m", ["1", "2"], None, [held("a", {"1", "2"})], sticky="1") == "2"
    assert route("m", ["1", "2"], None, [held("a", set(), failed={"1"})], sticky="1") == "2"
    assert route("m", ["2"], None, [], sticky="1") == "2"  # gone from the repository
