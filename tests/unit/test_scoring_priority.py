"""Plan priority in queue scoring: when load slots or permits are scarce, the queue of a
higher-priority plan is taken first; with room for all, priority changes nothing."""

from __future__ import annotations

from modelfleet.scheduling import QueueView, ScoringSettings, WorkerView, choose_queues

NOW = 1_000.0
SEED = 7
QUIET = ScoringSettings(noise_amplitude=0.0)


def test_one_load_slot_goes_to_the_starved_queue_of_the_higher_plan() -> None:
    # "a-free" has the bigger backlog (higher score) and the earlier name: without
    # priority it would win the only slot.
    queues = [QueueView("a-free", backlog=40, consumers=0, plan="free"),
              QueueView("z-enterprise", backlog=1, consumers=0, plan="enterprise")]
    worker = WorkerView("w1", free_permits=4, permits_cap=4, loader_room={"": 1})
    decision = choose_queues(queues, worker, QUIET, NOW, SEED)
    assert decision.subscribe == {"z-enterprise"}
    assert decision.reasons["a-free"] == "no-capacity"


def test_the_last_free_permit_goes_to_the_pressured_queue_of_the_higher_plan() -> None:
    queues = [QueueView("a-free", backlog=60, consumers=1, plan="free"),
              QueueView("b-pro", backlog=30, consumers=1, plan="pro")]
    worker = WorkerView("w1", free_permits=1, permits_cap=4)
    decision = choose_queues(queues, worker, QUIET, NOW, SEED)
    assert decision.subscribe == {"b-pro"}
    assert decision.reasons["a-free"] == "no-capacity"


def test_with_room_for_every_queue_priority_changes_nothing() -> None:
    queues = [QueueView("a-free", backlog=40, consumers=0, plan="free"),
              QueueView("z-enterprise", backlog=1, consumers=0, plan="enterprise")]
    worker = WorkerView("w1", free_permits=4, permits_cap=4, loader_room={"": 2})
    assert choose_queues(queues, worker, QUIET, NOW, SEED).subscribe == {"a-free",
                                                                         "z-enterprise"}


def test_priorities_come_from_the_settings_table() -> None:
    flat = ScoringSettings(noise_amplitude=0.0, plan_priority={})
    queues = [QueueView("a-free", backlog=40, consumers=0, plan="free"),
              QueueView("z-enterprise", backlog=1, consumers=0, plan="enterprise")]
    worker = WorkerView("w1", free_permits=4, permits_cap=4, loader_room={"": 1})
    assert choose_queues(queues, worker, flat, NOW, SEED).subscribe == {"a-free"}
    assert QUIET.priority("enterprise") > QUIET.priority("pro") > QUIET.priority("free")
    assert QUIET.priority("custom") == 0
