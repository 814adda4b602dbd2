"""Operators' orders: newest wins per field, whatever order the copies arrive in."""

from __future__ import annotations

import itertools

from modelfleet.control import Command, ControlState, Result, Revision, RevisionClock


def test_a_model_no_order_names_is_loaded_and_pinned_as_its_manifest_says() -> None:
    state = ControlState()
    assert state.loaded("m")
    assert state.pinned("m", default=True) and not state.pinned("m", default=False)
    assert state.version("m") is None


def test_the_newest_order_wins_in_any_arrival_order() -> None:
    orders = [("loaded", False, Revision(1.0, "a")), ("loaded", True, Revision(3.0, "b")),
              ("loaded", False, Revision(2.0, "c")), ("pinned", True, Revision(0.5, "a"))]
    for permutation in itertools.permutations(orders):
        state = ControlState()
        for field, value, revision in permutation:
            state.set("m", field, value, revision)  # type: ignore[arg-type]
        assert state.loaded("m") and state.pinned("m", False)


def test_fields_are_independent_an_unpin_does_not_undo_an_unload() -> None:
    state = ControlState()
    state.set("m", "loaded", False, Revision(1.0, "a"))
    state.set("m", "pinned", False, Revision(2.0, "a"))
    assert not state.loaded("m")


def test_a_copy_merges_into_another_and_reports_what_changed() -> None:
    first, second = ControlState(), ControlState()
    first.set("m", "loaded", False, Revision(5.0, "a"))
    first.set("n", "version", "2", Revision(5.0, "a"))
    second.set("m", "loaded", True, Revision(6.0, "b"))  # newer: stays
    assert second.merge(first.wire()) == ["n"]
    assert second.loaded("m") and second.version("n") == "2"
    assert second.merge(first.wire()) == []  # idempotent


def test_malformed_copies_are_skipped_entry_by_entry() -> None:
    state = ControlState()
    changed = state.merge({"m": {"loaded": [False, 1.0, "a"], "pinned": ["yes", 1.0, "a"],
                                 "colour": [1, 1.0, "a"], "version": [3, 1.0, "a"]},
                           "n": "not a map", 7: {}, "o": {"loaded": [True, True, "a"]}})
    assert changed == ["m"]
    assert not state.loaded("m") and state.pinned("m", False) is False
    assert state.merge(["not", "a", "map"]) == []


def test_a_gateway_stamps_strictly_increasing_revisions_even_if_its_clock_stalls() -> None:
    clock = RevisionClock("gw", clock=lambda: 100.0)
    first, second = clock.next(), clock.next()
    assert second > first and first.origin == "gw"


def test_commands_and_results_survive_the_event_channel() -> None:
    command = Command("c1", "m", "load", Revision(1.5, "gw"), "2", ("w1", "w2"), named=True)
    assert Command.from_event(command.event()) == command
    result = Result("c1", "w1", "m", "2", False, "model_load_failed", "boom")
    assert Result.from_event(result.event()) == result
    for broken in ({"kind": "control"}, {**command.event(), "action": "explode"},
                   {**command.event(), "workers": [1]}, {**command.event(), "at": "now"}):
        assert Command.from_event(broken) is None
    assert Result.from_event({**result.event(), "ok": "yes"}) is None


def test_each_command_records_its_order() -> None:
    state = ControlState()
    clock = RevisionClock("gw")
    Command("1", "m", "unload", clock.next()).apply(state)
    assert not state.loaded("m")
    Command("2", "m", "route", clock.next(), "1").apply(state)
    assert state.version("m") == "1"
    Command("3", "m", "load", clock.next(), "2", named=False).apply(state)
    assert state.loaded("m") and state.version("m") is None  # the route follows the newest
    Command("4", "m", "pin", clock.next()).apply(state)
    assert state.pinned("m", False)
    Command("5", "m", "unpin", clock.next()).apply(state)
    assert not state.pinned("m", True)


def test_a_load_gives_its_config_and_one_without_takes_it_back() -> None:
    state = ControlState()
    taken: list[tuple[str, str, object]] = []
    state.watch(lambda model, field, value: taken.append((model, field, value)))
    clock = RevisionClock("gw")
    command = Command("1", "m", "load", clock.next(), config='{"max_batch_size":4}')
    assert Command.from_event(command.event()) == command
    command.apply(state)
    assert state.config("m") == '{"max_batch_size":4}'
    assert ("m", "config", '{"max_batch_size":4}') in taken
    Command("2", "m", "pin", clock.next()).apply(state)
    assert state.config("m") == '{"max_batch_size":4}'  # other orders leave it
    Command("3", "m", "load", clock.next()).apply(state)
    assert state.config("m") == "" and taken[-1][1:] in (("config", ""), ("version", ""))
    copy = ControlState()
    copy.merge(state.wire())
    assert copy.config("m") == ""
