"""The coordinator in one process: the embedded broker, in-process runtimes, real handlers.

Settlement, deadlines, the suspect gate and the crash hand-back, each observed as a
caller or an operator would: by the replies in a gateway's inbox, the queues'
counts, the dead-letter queue and the worker's metrics. A runtime "crash" here is
``InProcessStarted.kill``: what a SIGKILL does to a runtime process as far as the
coordinator can tell (every call in flight fails with RuntimeCrashed, the
supervisor sees it end and starts another); tests/e2e/test_chaos.py kills real
processes.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import REGISTRY

from modelfleet.broker import QueueStats, cold_lane
from modelfleet.broker.embedded import MemoryBroker
from modelfleet.errors import DeadlineExceeded, InvalidInput
from modelfleet.ipc.flight import Flight
from modelfleet.messages import PayloadRef, Reply, Task, now_ms
from modelfleet.runtime.inprocess import InProcessLauncher
from modelfleet.settings import Settings
from modelfleet.worker.coordinator import Coordinator
from modelfleet.worker.supervisor import RuntimeSupervisor
from tests.fleet import in_process_fleet
from tests.procs import EXAMPLES, ask, write_package
from tests.waiting import eventually

# A model whose predict writes "start <text> <t>" and "end <text> <t>" lines to a log
# beside it, sleeps for the number in its input ("slow 0.5"), and echoes the text.
TIMED = '''
    from __future__ import annotations

    import time
    from pathlib import Path

    from modelfleet import Model, Request

    class Timed(Model):
        def load(self, ctx):
            self.log = Path(ctx.package_dir).parent.parent / "calls.log"

        async def preprocess(self, request: Request) -> str:
            return request.text()

        def predict(self, batch):
            out = []
            for text in batch:
                with self.log.open("a") as log:
                    log.write(f"start {text} {time.monotonic()}\\n")
                parts = text.split()
                time.sleep(float(parts[1]) if len(parts) > 1 else 0.0)
                with self.log.open("a") as log:
                    log.write(f"end {text} {time.monotonic()}\\n")
                out.append({"echo": text})
            return out
'''
MANIFEST = '''
    name = "{name}"
    version = "1"
    entrypoint = "handler:Timed"
    accepts = ["text/plain"]
    [batching]
    max_batch_size = 1
'''


def sample(name: str, labels: dict[str, str]) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


@dataclass
class Worker:
    broker: MemoryBroker
    coordinator: Coordinator
    supervisor: RuntimeSupervisor
    launcher: InProcessLauncher
    inbox_address: str
    replies: asyncio.Queue[Reply]
    calls_log: Path
    events: list[dict[str, Any]]  # every event on the broker since the worker started

    def task(self, text: str, deadline_s: float = 10, model: str = "timed") -> Task:
        body = text.encode()
        return Task(uuid.uuid4().hex, model, "1", now_ms() + int(deadline_s * 1000),
                    self.inbox_address, PayloadRef("inline", data=body, size_bytes=len(body)),
                    "text/plain", now_ms())

    async def publish(self, task: Task) -> None:
        """As a gateway does: the task on its queue, then the model's demand announced."""
        await self.broker.publish_task(task)
        await self.broker.publish_event({"kind": "demand", "model_id": task.model_id,
                                         "at": time.time()})

    async def reply(self, timeout_s: float = 20) -> Reply:
        return await asyncio.wait_for(self.replies.get(), timeout_s)

    def calls(self) -> list[tuple[str, str, float]]:
        """(start|end, text, monotonic time) for every predict call so far."""
        if not self.calls_log.exists():
            return []
        lines = [line.rsplit(" ", 1) for line in self.calls_log.read_text().splitlines()]
        return [(head.split(" ", 1)[0], head.split(" ", 1)[1], float(at))
                for head, at in lines]

    async def started(self, text: str, count: int = 1, timeout_s: float = 20) -> None:
        """Wait until predict has started on ``text`` ``count`` times."""
        await eventually(
            lambda: sum(1 for kind, t, _ in self.calls() if kind == "start" and t == text)
            >= count, timeout_s, what=f"predict starting on {text!r} ({count}x)")

    async def kill_runtime(self, name: str = "runtime-0") -> None:
        """Kill the process of runtime ``name`` (the shared one, or ``quarantine``)."""
        [runtime] = [r for r in self.supervisor.all() if r.name == name]
        live = runtime._started_runtime
        assert live is not None and live.exit_code is None
        await live.kill()


@pytest.fixture
async def worker(tmp_path: Path) -> AsyncIterator[Worker]:
    repo = tmp_path / "repo"
    write_package(repo, "timed", MANIFEST.format(name="timed"), TIMED)
    write_package(repo, "other", MANIFEST.format(name="other"), TIMED)  # same runtime
    write_package(repo, "pinned", MANIFEST.format(name="pinned") + "[fanout]\npinned = true\n",
                  TIMED)
    settings = Settings(repo=str(repo), state_dir=tmp_path / "state", broker={
        "url": "memory", "delivery_limit": 1}, worker={
        "worker_id": "w-test", "permits": 4, "rescore_interval_s": 0.1,
        "state_interval_s": 0.2, "standby_keep_s": 0, "restart_backoff_max_s": 0.2},
        runtime={"ping_interval_s": 0.1})
    async with in_process_fleet(settings, hear_events=True) as fleet:
        yield Worker(fleet.broker, fleet.coordinator, fleet.supervisor, fleet.launcher,
                     fleet.inbox_address, fleet.replies, repo / "calls.log", fleet.events)


async def settled(broker: MemoryBroker, model: str, timeout_s: float = 10) -> None:
    """Wait until the model's queue has nothing ready and nothing unacked."""
    seen = [""]  # what the queue held at the last look, for the failure

    async def empty() -> bool:
        stats = await broker.queue_stats([model])
        queue = broker._queues.get(f"model.{model}")
        unacked = queue.unacked if queue is not None else 0
        seen[:] = [f"{model}: {stats}, {unacked} unacked"]
        return (model not in stats or stats[model].backlog == 0) and unacked == 0

    await eventually(empty, timeout_s, what=f"{model}'s queue settling", state=lambda: seen[0])


async def test_a_task_is_answered_stamped_by_the_worker_and_acked(worker: Worker) -> None:
    task = worker.task("hello")
    await worker.publish(task)
    reply = await worker.reply()
    assert (reply.request_id, reply.status) == (task.request_id, "ok")
    assert reply.body == b'{"echo":"hello"}' and reply.cold
    assert reply.worker_id == "w-test"  # stamped in the runtime, given with the task
    assert reply.timings_ms["queue_wait"] >= 0 and "predict" in reply.timings_ms
    await settled(worker.broker, "timed")
    again = worker.task("again")
    await worker.publish(again)
    assert not (await worker.reply()).cold


async def test_a_task_past_its_deadline_is_dropped_unanswered(worker: Worker) -> None:
    before = sample("modelfleet_worker_expired_tasks_total", {"model": "timed"})
    expired = worker.task("late", deadline_s=-1)
    live = worker.task("live")
    await worker.publish(expired)
    await worker.publish(live)
    assert (await worker.reply()).request_id == live.request_id
    await settled(worker.broker, "timed")  # acked, not left for another worker
    assert worker.replies.empty()  # nobody waits for the late one: no reply is sent
    assert ("start", "late") not in {(k, t) for k, t, _ in worker.calls()}
    assert sample("modelfleet_worker_expired_tasks_total", {"model": "timed"}) == before + 1


async def test_a_deadline_that_passes_mid_predict_drops_the_task(worker: Worker) -> None:
    await worker.publish(worker.task("slow 1.0", deadline_s=0.5))
    await worker.started("slow 1.0")
    await settled(worker.broker, "timed")  # acked at the deadline: it does not come back
    # Predict has finished: a reply, were one sent, would be on its way from here.
    await eventually(lambda: ("end", "slow 1.0") in {(k, t) for k, t, _ in worker.calls()},
                     20, what="predict ending on 'slow 1.0'")
    await asyncio.sleep(1.0)
    assert worker.replies.empty()
    assert [k for k, t, _ in worker.calls() if t == "slow 1.0"].count("start") == 1


async def test_suspect_tasks_run_alone_in_quarantine_beside_the_shared_runtime(
        worker: Worker) -> None:
    """A suspect runs on the quarantine runtime, one at a time; ordinary tasks go on
    beside it on the shared runtime, not held back."""
    for model in ("timed", "other"):
        await worker.publish(worker.task("warm", model=model))
        await worker.reply()  # loaded: what follows is about running, not loading
    await worker.publish(worker.task("before 0.6", model="other"))
    await worker.started("before 0.6")
    # They were on a runtime that crashed: either may be the cause, so each runs alone.
    await worker.publish(replace(worker.task("suspect-a 0.4"), crashes=1))
    await worker.publish(replace(worker.task("suspect-b 0.4"), crashes=1))
    texts = {(await worker.reply(timeout_s=30)).body for _ in range(3)}
    assert texts == {b'{"echo":"before 0.6"}', b'{"echo":"suspect-a 0.4"}',
                     b'{"echo":"suspect-b 0.4"}'}
    starts = {t: at for kind, t, at in worker.calls() if kind == "start"}
    ends = {t: at for kind, t, at in worker.calls() if kind == "end"}
    first, second = sorted(("suspect-a 0.4", "suspect-b 0.4"), key=starts.__getitem__)
    assert starts[second] >= ends[first]  # alone in quarantine
    assert "quarantine" in {r.name for r in worker.supervisor.all()}
    assert worker.supervisor.shared[0].restarts == 0


async def test_a_task_waiting_for_its_runtimes_restart_runs_in_quarantine_once_its_model_crashed(
        worker: Worker, monkeypatch: pytest.MonkeyPatch) -> None:
    """A task taken for the shared runtime a moment before the runtime went down with its
    model marked crashing (what a pill's crash does: the runtime's flight record names
    the model) does not wait for the restart to run there, where its model's next pill
    would crash the restarted runtime again: it runs in quarantine."""
    await worker.publish(worker.task("warm"))
    await worker.reply()
    runtime_0 = worker.supervisor.shared[0]
    # Hold the task right after it was taken for runtime-0 (up then), and hold
    # runtime-0's restart: the crash lands in between.
    taken, go_on, restart = asyncio.Event(), asyncio.Event(), asyncio.Event()
    wait_settled, launch = runtime_0.wait_settled, worker.launcher.launch

    async def held_after_taking(timeout_s: float) -> bool:
        taken.set()
        await go_on.wait()
        return await wait_settled(timeout_s)

    async def held_restart(name: str, *args: Any, **kwargs: Any) -> Any:
        if name == "runtime-0":
            await restart.wait()
        return await launch(name, *args, **kwargs)

    monkeypatch.setattr(runtime_0, "wait_settled", held_after_taking)
    monkeypatch.setattr(worker.launcher, "launch", held_restart)
    waiting = worker.task("slow 1.0")
    await worker.publish(waiting)
    await asyncio.wait_for(taken.wait(), 20)
    monkeypatch.setattr(runtime_0, "wait_settled", wait_settled)
    tasks = worker.coordinator._tasks
    assert not tasks.quarantined  # taken for runtime-0
    await worker.kill_runtime()
    await eventually(lambda: not runtime_0.ready, what="runtime-0 down")
    worker.supervisor.mark_crashing("timed")  # as runtime-0's flight record of a pill does
    go_on.set()
    restart.set()
    await worker.started("slow 1.0")
    assert tasks.quarantined["timed"] == 1  # running there, not on the restarted runtime-0
    reply = await worker.reply(timeout_s=30)
    assert (reply.request_id, reply.status) == (waiting.request_id, "ok")
    assert runtime_0.restarts == 1


async def test_a_crash_hands_the_task_back_and_the_restarted_runtime_answers(
        worker: Worker) -> None:
    handed_back = sample("modelfleet_worker_tasks_handed_back_total", {"model": "timed"})
    task = worker.task("victim 1.0")
    await worker.publish(task)
    await worker.started("victim 1.0")
    await worker.kill_runtime()
    reply = await worker.reply(timeout_s=30)
    assert (reply.request_id, reply.status) == (task.request_id, "ok")
    assert [k for k, t, _ in worker.calls() if t == "victim 1.0"].count("start") == 2
    assert sample("modelfleet_worker_tasks_handed_back_total", {"model": "timed"}) \
        == handed_back + 1
    assert worker.supervisor.shared[0].restarts == 1
    await settled(worker.broker, "timed")


async def test_a_task_alone_on_a_runtime_that_died_of_another_request_is_not_charged(
        worker: Worker, monkeypatch: pytest.MonkeyPatch) -> None:
    """A task handed to the shared runtime as it dies of another task's input (that
    task's call ended first, so this one was alone on it) is a bystander: the runtime's
    flight record names the other request, not this one. It runs again at once on the
    restarted runtime, and its model is not sent to quarantine."""
    bystanders = sample("modelfleet_worker_crash_bystanders_total", {"model": "timed"})
    task = worker.task("late 1.0")
    await worker.publish(task)
    await worker.started("late 1.0")
    target = worker.supervisor.shared[0].runtime
    assert target is not None
    # What a runtime process killed by a pill's predict leaves (in-process ones keep none).
    monkeypatch.setattr(target, "crash_record", lambda: Flight(
        models=frozenset({"other"}), requests=frozenset({"the-pill"}), loading=frozenset()))
    await worker.kill_runtime()
    reply = await worker.reply(timeout_s=30)
    assert (reply.request_id, reply.status) == (task.request_id, "ok")
    assert not worker.supervisor.crashing("timed")
    assert not worker.coordinator._tasks.quarantined
    assert sample("modelfleet_worker_crash_bystanders_total", {"model": "timed"}) \
        == bystanders + 1
    assert [k for k, t, _ in worker.calls() if t == "late 1.0"].count("start") == 2


async def test_a_task_that_crashes_its_runtime_alone_each_time_is_dead_lettered(
        worker: Worker) -> None:
    """Its first crash is on the shared runtime; redelivered, it runs in quarantine,
    alone, and its crash there is evidence enough."""
    poison = worker.task("poison 3.0", deadline_s=60)
    await worker.publish(poison)
    for attempt, runtime in ((1, "runtime-0"), (2, "quarantine")):
        await worker.started("poison 3.0", count=attempt)
        await worker.kill_runtime(runtime)
    reply = await worker.reply(timeout_s=30)
    assert (reply.request_id, reply.status, reply.error_code) == \
        (poison.request_id, "error", "runtime_crashed")
    assert "dead-lettered" in reply.error_message and "alone" in reply.error_message
    dead = await worker.broker.subscribe_dead_letters(prefetch=1)
    letter = await asyncio.wait_for(anext(aiter(dead)), 5)
    assert letter.task.request_id == poison.request_id
    assert letter.death_reason.startswith(
        "runtime_crashed: crashed the quarantine runtime, where it ran alone")
    await letter.ack()
    await dead.cancel()
    # The runtime came back and serves the next task.
    await worker.publish(worker.task("next"))
    assert (await worker.reply(timeout_s=30)).status == "ok"


async def test_pinned_models_are_preloaded_and_come_back_after_a_crash(worker: Worker) -> None:
    def pinned_resident() -> bool:
        return "pinned" in worker.coordinator.state()["resident"]["device"]

    await eventually(pinned_resident)  # with no request at all
    assert worker.calls() == []  # loaded, never run
    await worker.kill_runtime()
    await eventually(lambda: worker.supervisor.shared[0].restarts == 1
                     and worker.supervisor.shared[0].ready)
    restarted = worker.supervisor.shared[0].runtime  # the new runtime came back empty...
    assert restarted is not None and restarted is not worker.launcher.started[0].runtime
    async def pin_back() -> bool:
        return "pinned" in (await restarted.stats()).pinned

    await eventually(pin_back, 20, what="the pin coming back")  # ...and got the pin back
    await eventually(pinned_resident)
    assert worker.calls() == []  # all of it unasked
    state = worker.coordinator.state()
    # The quarantine runtime stands beside it (worker.quarantine_standing), untouched.
    assert state["runtimes"] == [
        {"name": "runtime-0", "state": "ready", "restarts": 1, "spare": "none"},
        {"name": "quarantine", "state": "ready", "restarts": 0, "spare": "none"}]


async def test_a_gateway_and_a_worker_in_one_process_answer_and_refuse(tmp_path: Path) -> None:
    """GatewayService, Coordinator and a runtime on one event loop: the whole request path."""
    settings = Settings(repo=str(EXAMPLES), state_dir=tmp_path, worker={"worker_id": "w1"})
    async with in_process_fleet(settings, gateway=True) as fleet:
        service = fleet.service
        answer = await ask(service, "iris", None, b'{"features": [5.1, 3.5, 1.4, 0.2]}',
                                     "application/json", now_ms() + 30_000, {})
        assert json.loads(answer.body)["class"] == "setosa"
        assert answer.reply.worker_id == "w1" and answer.reply.cold
        with pytest.raises(InvalidInput):
            await ask(service, "iris", None, b'{"features": [1]}', "application/json",
                                now_ms() + 30_000, {})
        with pytest.raises(DeadlineExceeded):
            await ask(service, "slowload", None, b'{"n": 1}', "application/json",
                                now_ms() + 300, {})


async def test_a_task_in_the_cold_lane_is_run_without_a_subscription(worker: Worker) -> None:
    """A gateway sent a request for a model nobody held to the cold lane: the worker runs
    it from there, never subscribing to the model's own queue for it."""
    before = sample("modelfleet_worker_cold_lane_tasks_total", {})
    task = worker.task("lane")
    await worker.broker.publish_task(task, cold_lane(0))
    reply = await worker.reply()
    assert reply.request_id == task.request_id and reply.status == "ok" and reply.cold
    assert sample("modelfleet_worker_cold_lane_tasks_total", {}) == before + 1
    assert "timed" not in worker.coordinator.state()["subscriptions"]
    assert await worker.broker.queue_stats(["timed"]) == {}  # its own queue: never declared


async def test_the_queue_of_a_model_a_lane_brought_is_not_asked_for_until_announced(
        worker: Worker, monkeypatch: pytest.MonkeyPatch) -> None:
    """A model a cold lane brought is resident, so a candidate at every re-score, but it
    has no queue of its own: on RabbitMQ asking for one is a passive declare the broker
    answers by closing a channel. Not asked for until a demand event names the model."""
    asked: list[str] = []
    queue_stats = worker.broker.queue_stats

    async def counting(model_ids: list[str]) -> dict[str, QueueStats]:
        asked.extend(model_ids)
        return await queue_stats(model_ids)

    monkeypatch.setattr(worker.broker, "queue_stats", counting)
    task = worker.task("lane", model="other")
    await worker.broker.publish_task(task, cold_lane(0))
    assert (await worker.reply()).status == "ok"
    for full in (True, False, True):
        await worker.coordinator._rescore(full=full)
    assert "other" not in asked
    # A task published to its queue and announced, as a gateway does: asked, and served.
    follow = worker.task("queued", model="other")
    await worker.publish(follow)
    reply = await worker.reply()
    assert (reply.request_id, reply.status) == (follow.request_id, "ok")
    assert "other" in asked


async def test_leaving_the_cold_lanes_while_a_task_is_passed_on_leaves_nothing_unsettled(
        worker: Worker, monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker leaves the lanes when it cannot take work (its runtime went down), just
    when what arrives from them is being passed on to the models' own queues: the pass-on
    in progress finishes (the task in its model's queue once, the lane's copy acked)
    instead of being cut short with the lane's delivery held unsettled until its caller's
    deadline."""
    passing, go_on = asyncio.Event(), asyncio.Event()
    republish = worker.broker.republish

    async def held(task: Task) -> None:
        passing.set()
        await go_on.wait()
        await republish(task)

    monkeypatch.setattr(worker.broker, "republish", held)
    task = worker.task("ghost", model="newmodel")
    await worker.broker.publish_task(task, cold_lane(0))
    await asyncio.wait_for(passing.wait(), 20)
    leaving = asyncio.create_task(worker.coordinator._lanes.leave())
    await asyncio.sleep(0.05)  # the lane's consumer cancelled meanwhile
    go_on.set()
    await leaving
    await settled(worker.broker, cold_lane(0))  # acked: nothing held, nothing back
    await eventually(lambda: any(e.get("kind") == "demand" and e.get("model_id") == "newmodel"
                                 for e in worker.events),
                     10, what="the task's model announced once moved")
    stats = await worker.broker.queue_stats(["newmodel"])
    assert stats["newmodel"].backlog == 1


async def test_leaving_the_cold_lanes_as_a_task_it_runs_arrives_loses_nothing(
        worker: Worker, monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker leaves the lanes (its runtime went down) just as a task it would run
    arrives from them: the task is run, or goes back to the lane, never held unanswered.
    (It was dropped between the check and the start, its delivery held unsettled until
    its caller's 60 s deadline: the pill test's innocent neighbour, on a busy machine.)"""
    lanes = worker.coordinator._lanes
    accepting = lanes._accepting
    leaving: list[asyncio.Task[None]] = []

    def runtime_goes_down_now(model_id: str) -> bool:
        if not leaving:
            leaving.append(asyncio.create_task(lanes.leave()))
        return accepting(model_id)

    monkeypatch.setattr(lanes, "_accepting", runtime_goes_down_now)
    task = worker.task("lane")
    await worker.broker.publish_task(task, cold_lane(0))
    reply = await asyncio.wait_for(worker.reply(), 30)
    assert reply.request_id == task.request_id and reply.status == "ok"
    assert leaving
    await leaving[0]
    await settled(worker.broker, cold_lane(0))


async def test_a_cold_lane_task_this_worker_cannot_run_goes_to_its_models_queue(
        worker: Worker) -> None:
    """A model this worker's catalog does not know (published a moment ago, say) is not
    failed here: the task moves to its model's own queue, announced, for a worker that
    knows it."""
    task = worker.task("ghost", model="newmodel")
    await worker.broker.publish_task(task, cold_lane(0))
    await eventually(lambda: any(e.get("kind") == "demand" and e.get("model_id") == "newmodel"
                                 for e in worker.events),
                     10, what="the task's model announced once moved")
    stats = await worker.broker.queue_stats(["newmodel", cold_lane(0)])
    assert stats["newmodel"].backlog == 1 and stats[cold_lane(0)].backlog == 0
    assert worker.replies.empty()  # not failed: nobody was told anything
