"""One delivered task, from its delivery to its settlement.

A task is acked only after its reply is published (at-least-once). Expired and
cancelled tasks are acked and dropped unrun, and a reply that comes back after the
task's deadline is dropped too: its caller has its 504 already. A task whose runtime
crashed under it goes back to the broker as a new message carrying its crash evidence,
or to the dead-letter queue once it crashed its runtime alone too often
(``hand_back``); the dead runtime's flight record (``ipc/flight.py``) clears the tasks
whose model code was not running, which run again at once. A suspect runs on the
quarantine runtime, alone (the suspect gate), where its crash costs the healthy models
on the shared runtimes nothing.

The coordinator decides which queues to pull and holds the permits; this runs what
they deliver. The reply crosses here as the runtime's bytes (``EncodedReply``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import replace

from modelfleet import metrics
from modelfleet.backoff import Backoff
from modelfleet.broker import Broker, Delivery
from modelfleet.errors import BrokerUnavailable, ModelfleetError, RuntimeCrashed
from modelfleet.ipc.flight import Flight
from modelfleet.ipc.protocol import InferCall, Runtime
from modelfleet.messages import EncodedReply, Reply, Task, now_ms
from modelfleet.repository import Catalog
from modelfleet.settings import Settings
from modelfleet.worker.control import ControlAgent
from modelfleet.worker.gate import CrashWitness, SuspectGate
from modelfleet.worker.supervised_runtime import SupervisedRuntime
from modelfleet.worker.supervisor import RuntimeSupervisor
from modelfleet.worker.tasklog import TaskLog

# Memory refusals of a shared runtime asked again (see _past_memory_refusals), by code.
MEMORY_RETRIES = {"no_capacity": 8, "model_too_large": 4}
MEMORY_RETRY_PAUSE_S = 0.1

log = logging.getLogger("modelfleet.worker")


class TaskRunner:
    def __init__(self, settings: Settings, broker: Broker, catalog: Catalog,
                 supervisor: RuntimeSupervisor, worker_id: str, control: ControlAgent,
                 task_log: TaskLog,
                 stop_pulling: Callable[[SupervisedRuntime], Awaitable[None]],
                 clock: Callable[[], float]) -> None:
        self._settings = settings
        self._broker = broker
        self._catalog = catalog
        self._supervisor = supervisor
        self.worker_id = worker_id
        self.control = control
        self._task_log = task_log
        self._stop_pulling = stop_pulling
        self._clock = clock
        self.running: Counter[str] = Counter()  # model id -> tasks in flight here
        self.quarantined: Counter[str] = Counter()  # ... of them on the quarantine runtime
        self.last_served: dict[str, float] = {}  # model id -> when a task of it last ended
        self._gates: dict[str, SuspectGate] = {}  # runtime name -> its gate
        self._witnesses: dict[str, CrashWitness] = {}  # runtime name -> who ran alone
        self._deadlines: dict[str, asyncio.Timeout] = {}  # request id -> its running deadline
        self._cancelled: dict[str, float] = {}  # request ids whose callers hung up -> when
        self._on_runtime: dict[str, Runtime] = {}  # request id -> the runtime it is on now
        self._cancels: set[asyncio.Task[None]] = set()  # cancels on their way to a runtime

    def cancel(self, request_id: str) -> None:
        """The caller hung up: its task ends as if its deadline had passed.

        A task on a runtime is cancelled there too (``Runtime.cancel``): the runtime
        stops its fetch or preprocess, it never reaches predict, and the runtime's answer
        ends the call, so that the permit and the runtime's slot are freed together (if
        the runtime does not answer the cancel, the call is abandoned after
        ``runtime.ping_timeout_s``). Any other task running here has its deadline moved
        to now; one not delivered yet is remembered, and dropped unrun when it arrives.
        """
        now = self._clock()
        self._cancelled[request_id] = now
        horizon = now - self._settings.gateway.max_timeout_s
        while self._cancelled and next(iter(self._cancelled.values())) < horizon:
            self._cancelled.pop(next(iter(self._cancelled)))
        timeout = self._deadlines.get(request_id)
        target = self._on_runtime.get(request_id)
        if target is not None and timeout is not None:
            sent = asyncio.create_task(self._cancel_on(target, request_id, timeout))
            self._cancels.add(sent)
            sent.add_done_callback(self._cancels.discard)
        elif timeout is not None:
            timeout.reschedule(asyncio.get_running_loop().time())

    async def _cancel_on(self, target: Runtime, request_id: str,
                         deadline: asyncio.Timeout) -> None:
        """Tell the runtime; its answer to the call follows. Abandon the call meanwhile
        only when the runtime cannot be told, or after ``ping_timeout_s`` as a backstop."""
        loop = asyncio.get_running_loop()
        backstop_s = self._settings.runtime.ping_timeout_s
        try:
            there = await target.cancel(request_id, timeout_s=backstop_s)
        except (ModelfleetError, TimeoutError, OSError) as exc:
            log.info("cancelling %s on its runtime: %s", request_id, exc)
            there = False
        if not deadline.expired():
            deadline.reschedule(loop.time() + (backstop_s if there else 0.0))

    async def run(self, delivery: Delivery) -> None:
        """Run one delivered task on its runtime and settle it: exactly one of reply and
        ack, ack unanswered (expired, cancelled), hand back (its runtime crashed), or
        dead-letter. Never raises but for cancellation (a drain), which hands it back."""
        task = delivery.task
        received_ms = now_ms()
        log.debug("task %s of %s received (delivery %d, crashes %d, cleared %d)",
                  task.request_id, task.model_id, task.delivery_count, task.crashes,
                  task.crashes_cleared)
        self.running[task.model_id] += 1
        runtime: SupervisedRuntime | None = None
        try:
            if task.expired(received_ms) or task.request_id in self._cancelled:
                self._count_dropped(task)
                await delivery.ack()
                return
            refusal = self.control.refusal(task.model_id)
            if refusal is not None:  # queued before an operator unloaded it
                await self._settle_with_failure(delivery, refusal)
                return
            # The least-loaded runtime holding the model (worker/spread.py), counted there.
            # Suspect work goes to the quarantine runtime instead (worker/supervisor.py).
            runtime = self._supervisor.take(task.model_id, suspect=task.suspect)
            if self._supervisor.is_quarantine(runtime):
                self.quarantined[task.model_id] += 1
            if not await runtime.wait_settled((task.deadline_ms - now_ms()) / 1000):
                # Its runtime is (re)starting and the deadline passed meanwhile: nobody waits.
                self._count_dropped(task)
                await delivery.ack()
                return
            if runtime.failure is not None:  # cannot start (e.g. its environment won't build)
                runtime.request_retry()
                await self._settle_with_failure(delivery, runtime.failure)
                return
            try:
                async with asyncio.timeout(max(0.0, (task.deadline_ms - now_ms()) / 1000)) \
                        as deadline:
                    self._deadlines[task.request_id] = deadline
                    if task.request_id in self._cancelled:  # hung up while it waited
                        deadline.reschedule(asyncio.get_running_loop().time())

                    async def attempt() -> EncodedReply:
                        nonlocal runtime  # it may move: the handlers below see where to
                        while True:
                            assert runtime is not None
                            try:
                                return await self._run_on(runtime, delivery, queue_wait_ms=max(
                                    0, received_ms - task.enqueued_ms))
                            except _NowQuarantined:
                                runtime = self._supervisor.to_quarantine(
                                    task.model_id, runtime, task.suspect)
                                self.quarantined[task.model_id] += 1

                    reply = await attempt()
                    tries = 0
                    while (code := self._memory_refusal(runtime, reply, tries)) is not None:
                        tries += 1
                        runtime = await self._before_memory_retry(runtime, task, code, tries)
                        reply = await attempt()
            except TimeoutError:
                self._count_dropped(task)
                await delivery.ack()
                return
            except _Crashed as crashed:
                if crashed.alone:
                    self._supervisor.mark_crashing(task.model_id)
                elif crashed.record is not None and task.model_id in crashed.record.models:
                    # Its model's tasks go to quarantine from now on, its queue with them.
                    self._supervisor.mark_crashing(task.model_id, recorded_on=runtime)
                # Stop pulling this runtime's queues first, so the task handed back goes to
                # another worker or waits for the restart instead of bouncing straight back.
                # (A crash in quarantine stops nothing: no queue is pulled for it.)
                await self._stop_pulling(runtime)
                await self._hand_back(delivery, crashed.error, crashed.alone,
                                      self._supervisor.is_quarantine(runtime), crashed.record)
                return
            self.last_served[task.model_id] = self._clock()
            if task.expired() or task.request_id in self._cancelled:
                # Its caller's deadline passed while it ran (the runtime may have said so
                # itself, at the same instant): nobody waits for a reply any more.
                self._count_dropped(task)
                await delivery.ack()
                return
            await self._reply_and_ack(delivery, reply)
            metrics.TASKS.labels(task.model_id, reply.status).inc()
            self._task_log.settled(task, reply)
        except BrokerUnavailable as exc:
            # Could not even hand it back: its channel is gone with the connection, and
            # the broker redelivers it (a reply sent already makes that a duplicate).
            log.warning("task %s for %s: %s; the broker redelivers it", task.request_id,
                        task.model_id, exc)
        except ModelfleetError as exc:
            # The runtime could not run it and said why: the caller hears it, the task is done.
            await self._settle_with_failure(delivery, exc)
        except Exception as exc:
            # A bug of ours. Settle the task anyway, where someone will look at it.
            log.exception("task %s for %s failed in the worker", task.request_id, task.model_id)
            with contextlib.suppress(BrokerUnavailable, RuntimeError):
                await self._broker.publish_reply(task.reply_to, EncodedReply.of(Reply.failure(
                    task.request_id, ModelfleetError(f"worker error: {exc!r}"),
                    worker_id=self.worker_id)))
                await delivery.dead_letter(f"worker_error: {exc!r}")
        except asyncio.CancelledError:
            with contextlib.suppress(BrokerUnavailable, RuntimeError):
                await delivery.reject(requeue=True)  # drained past the timeout: hand it back
            raise
        finally:
            if runtime is not None:
                if self._supervisor.is_quarantine(runtime):
                    self.quarantined[task.model_id] -= 1
                    if not self.quarantined[task.model_id]:
                        del self.quarantined[task.model_id]
                self._supervisor.done(task.model_id, runtime)
            self._deadlines.pop(task.request_id, None)
            self._on_runtime.pop(task.request_id, None)
            self.running[task.model_id] -= 1
            if not self.running[task.model_id]:
                del self.running[task.model_id]

    def running_placed(self) -> set[str]:
        """Models with a task in flight on a shared or own runtime (not in quarantine):
        those a shared runtime's load slots and placement must count."""
        return {m for m, n in self.running.items() if n > self.quarantined[m]}

    def _count_dropped(self, task: Task) -> None:
        self._task_log.dropped(task, "client_disconnected" if task.request_id in self._cancelled
                               else "deadline_exceeded")
        if task.request_id in self._cancelled:
            metrics.CANCELLED_TASKS.labels(task.model_id).inc()
        else:
            metrics.EXPIRED_TASKS.labels(task.model_id).inc()

    async def _settle_with_failure(self, delivery: Delivery, error: ModelfleetError) -> None:
        task = delivery.task
        reply = EncodedReply.of(Reply.failure(task.request_id, error, worker_id=self.worker_id))
        await self._reply_and_ack(delivery, reply)
        metrics.TASKS.labels(task.model_id, "error").inc()
        self._task_log.settled(task, reply)

    async def _reply_and_ack(self, delivery: Delivery, reply: EncodedReply) -> None:
        """Send the reply, then ack: through a broker reconnect, never left unsettled.

        While the connection is down (or not yet known to be back: a restored consumer
        can deliver before the connection says so), the reply is retried until the
        task's deadline; after it nobody waits, and the task is only acked. The ack is
        tried once: a delivery whose channel died with the old connection cannot be
        acked, and the broker redelivers it (the gateway ignores a duplicate reply).
        A task held this way keeps its permit, so the worker takes no more work than it
        can settle.
        """
        task = delivery.task
        await self._through_reconnects(
            task, "reply", lambda: self._broker.publish_reply(task.reply_to, reply))
        try:
            await delivery.ack()
        except BrokerUnavailable as exc:
            log.info("task %s answered; its ack was lost with the connection (%s): the "
                     "broker redelivers it, and the duplicate reply is ignored",
                     task.request_id, exc)

    async def _through_reconnects(self, task: Task, what: str,
                                  send: Callable[[], Awaitable[object]]) -> bool:
        """``send`` until the broker takes it, retrying until ``task``'s deadline.

        True once sent; False when the deadline passed first (nobody waits any more).
        """
        backoff = Backoff(0.05, 1.0)
        while True:
            try:
                await send()
                return True
            except BrokerUnavailable as exc:
                if task.expired():
                    log.info("%s for %s dropped: the broker was down until its deadline "
                             "(%s)", what, task.request_id, exc)
                    return False
                await backoff.sleep()

    def _memory_refusal(self, runtime: SupervisedRuntime, reply: EncodedReply,
                        tries: int) -> str | None:
        """The code of a shared runtime's refusal for memory that is worth asking again
        after ``tries`` (``no_capacity``: its RSS guard; ``model_too_large``: a budget
        moved away under a concurrent miss), within the task's deadline instead of
        failing the caller; None otherwise. A model that does not fit at all is still
        refused after MEMORY_RETRIES[code] tries."""
        if reply.status != "error" or not self._supervisor.is_shared(runtime):
            return None
        code = reply.decode().error_code
        return code if tries < MEMORY_RETRIES.get(code, 0) else None

    async def _before_memory_retry(self, runtime: SupervisedRuntime, task: Task, code: str,
                                   tries: int) -> SupervisedRuntime:
        """Where to ask again, after a pause. An RSS guard holds its runtime over the line
        until it has shed, which may take seconds: the task moves to another shared
        runtime (``supervisor.elsewhere``). A budget moved away is asked again where it
        is: the pool moves room in well under a second."""
        metrics.MEMORY_RETRIES.labels(code).inc()
        self._supervisor.refused_for_memory(runtime, task.model_id)
        if code == "no_capacity":
            runtime = self._supervisor.elsewhere(task.model_id, runtime)
        await asyncio.sleep(MEMORY_RETRY_PAUSE_S * tries)
        return runtime

    async def _run_on(self, runtime: SupervisedRuntime, delivery: Delivery,
                      queue_wait_ms: float) -> EncodedReply:
        """Run the task on its runtime once the runtime is up and the gate lets it in.

        A redelivered task may be the one that crashed a runtime: it runs alone (the
        suspect gate). A task whose runtime went down while it waited for its turn never
        ran there: it waits for the restart and goes in then, without being charged a
        delivery for a crash it had no part in (three crashes in a row otherwise
        dead-letter an innocent task that was only queued behind a poison pill).
        """
        task = delivery.task
        gate = self._gates.setdefault(runtime.name, SuspectGate())
        witness = self._witnesses.setdefault(runtime.name, CrashWitness())
        # In quarantine every task runs alone: a crash there names its cause.
        alone_only = task.suspect or self._supervisor.is_quarantine(runtime)
        while True:
            if self._supervisor.is_shared(runtime) \
                    and self._supervisor.quarantines(task.model_id, task.suspect):
                # Its model was marked crashing since it was taken (its runtime's crash,
                # this task queued behind the pill): not the restarted runtime, then.
                raise _NowQuarantined
            async with gate.slot(suspect=alone_only,
                                 crashes=task.crashes - task.crashes_cleared):
                target = runtime.runtime  # the one _infer calls (read before its first await)
                if runtime.ready and target is not None:
                    with witness.on_runtime() as alone:
                        try:
                            return await self._infer(runtime, delivery, queue_wait_ms)
                        except RuntimeCrashed as exc:
                            # Its flight record, when the runtime is gone (not merely slow).
                            record = target.crash_record()
                            raise _Crashed(exc, charged_alone(alone(), record, task),
                                           record) from exc
            await runtime.wait_settled(float("inf"))  # bounded by the task's deadline
            if runtime.failure is not None and not runtime.ready:
                runtime.request_retry()
                raise runtime.failure
            await asyncio.sleep(0.01)  # settled but not yet handed a client: a moment

    async def _infer(self, runtime: SupervisedRuntime, delivery: Delivery,
                     queue_wait_ms: float) -> EncodedReply:
        """The task's bytes go to the runtime as the broker gave them; its reply comes
        back encoded, stamped with what this worker adds, and is passed on as bytes."""
        task = delivery.task
        target = runtime.runtime
        if target is None or not runtime.ready:
            raise RuntimeCrashed(f"runtime {runtime.name} is not ready")
        entry = self._catalog.get(task.model_id)
        # The task's own version's accepts (a rollout may have added a newer one); one
        # this worker's catalog does not know yet: the newest's, and the runtime's load
        # of that version answers for it.
        manifest = next((m for m in entry.versions if m.version == task.version),
                        entry.manifest)
        remaining_s = max(0.0, (task.deadline_ms - now_ms()) / 1000)
        override = self._catalog.override(task.model_id)
        call = InferCall(delivery.body, task.delivery_count, tuple(manifest.accepts),
                         self.worker_id, queue_wait_ms,
                         override.batching() if override is not None else {})
        await self._supervisor.prepare(runtime, task.model_id)  # a miss: the pool makes room
        self._on_runtime[task.request_id] = target
        try:
            return await target.infer(
                call, timeout_s=remaining_s + self._settings.runtime.ping_timeout_s)
        except TimeoutError as exc:
            raise RuntimeCrashed(f"runtime {runtime.name} did not answer in time") from exc
        except RuntimeCrashed:
            runtime.connection_lost()  # before the gate lets the next task in
            raise

    async def _hand_back(self, delivery: Delivery, exc: RuntimeCrashed, alone: bool,
                         quarantined: bool = False,
                         record: Flight | None = None) -> None:
        """A runtime crashed with this task in flight: charge it only if it was alone.

        The task goes back to its queue as a new message carrying its crash evidence
        (published and confirmed before the old one is acked), so the broker's own
        delivery count, which also counts consumers that went away, decides nothing
        here. A task is dead-lettered, and its caller answered at once, when it has
        crashed a runtime alone more than ``broker.delivery_limit`` times: that is
        evidence, and the dead letter is classified deterministic. A task that keeps
        sharing crashes (the suspect gate makes that rare) is dead-lettered after twice
        as many, as transient.

        A crash on the quarantine runtime, where every task runs alone, is that evidence
        at its strongest: the task is dead-lettered once it has crashed a runtime alone
        ``worker.quarantine_crash_limit`` times (one by default), so that a poison pill's
        caller hears it within seconds. Its model's next tasks go to quarantine too for
        a while (``RuntimeSupervisor.mark_crashing``), so that its next pill, which
        nobody can tell from its innocents, crashes no shared runtime.

        The dead runtime's flight ``record`` (``ipc/flight.py``), when it names what ran,
        tells bystanders from suspects: a task in a predict that ran (or of a model that
        was loading) is a suspect; the model of any of them has its next tasks sent to
        quarantine too (``mark_crashing``: so the pills still queued crash no shared
        runtime either); any other task was not running model code on a thread when the
        runtime died, so it goes back cleared, not a suspect, and runs again at once (on
        the restarted runtime, or ahead of the suspects in quarantine) rather than waiting
        its turn behind the pills. A task is cleared once: if it shares a
        second crash, it is a suspect however the record reads (a crash on the event
        loop, in ``preprocess``, names nobody and so clears nobody).
        """
        task = delivery.task
        limit = self._settings.broker.delivery_limit
        ran = record is not None and bool(record.models)  # it names what ran
        named = ran and record is not None and record.suspects(task.model_id, task.request_id)
        cleared = ran and not named and not alone and not quarantined \
            and task.crashes_cleared == 0
        evidence = replace(task, crashes=task.crashes + 1,
                           crashes_alone=task.crashes_alone + (1 if alone else 0),
                           crashes_cleared=task.crashes_cleared + (1 if cleared else 0))
        if alone:
            self._supervisor.mark_crashing(task.model_id)
        proven = quarantined and alone and evidence.crashes_alone >= min(
            limit + 1, self._settings.worker.quarantine_crash_limit)
        if proven or evidence.crashes_alone > limit or evidence.crashes > 2 * limit + 1:
            if proven:
                reason = (f"crashed the quarantine runtime, where it ran alone "
                          f"({evidence.crashes_alone} of its {evidence.crashes} crashes "
                          f"alone): {exc}")
            elif evidence.crashes_alone > limit:
                reason = (f"crashed its runtime alone on each of {evidence.crashes_alone} "
                          f"deliveries: {exc}")
            else:
                reason = (f"was on {evidence.crashes} runtimes that crashed, never alone "
                          f"on one: {exc}")
            failure = EncodedReply.of(replace(
                Reply.failure(task.request_id, exc, worker_id=self.worker_id),
                error_message=f"model '{task.model_id}': {reason}; dead-lettered"))
            metrics.DEAD_LETTERED.labels(task.model_id, "runtime_crashed").inc()
            self._task_log.handed_back(task, "dead_lettered")
            await self._through_reconnects(
                task, "reply", lambda: self._broker.publish_reply(task.reply_to, failure))
            await delivery.dead_letter(f"runtime_crashed: {reason}")
            return
        metrics.REDELIVERED.labels(task.model_id).inc()
        if cleared:
            metrics.CRASH_BYSTANDERS.labels(task.model_id).inc()
        log.info("task %s of %s handed back %s (its runtime's flight record: %s)",
                 task.request_id, task.model_id,
                 "cleared: it runs again at once" if cleared else "a suspect: it runs alone",
                 "unknown" if record is None else ", ".join(sorted(record.models)) or "nothing")
        self._task_log.handed_back(task, "runtime_crashed")
        # Sent, or past its deadline with nobody waiting: either way this copy is done.
        await self._through_reconnects(task, "hand-back",
                                       lambda: self._broker.republish(evidence))
        await delivery.ack()
        await self.announce_queued(task.model_id)

    async def announce_queued(self, model_id: str) -> None:
        """Tell the fleet a task of ``model_id`` waits in its queue now, put there by this
        worker (a hand-back, or a cold-lane task passed on): no gateway announces it (one
        that sent it to the cold lane counts it there). Without a count and marked
        ``requeued``, so that workers count the queue exactly (the gateways' counts do
        not include it: worker/announced.py). Best effort."""
        with contextlib.suppress(BrokerUnavailable):
            await self._broker.publish_event({"kind": "demand", "model_id": model_id,
                                              "at": time.time(), "requeued": True})


def charged_alone(alone: bool, record: Flight | None, task: Task) -> bool:
    """Is a task that was alone on a runtime when it died charged with the crash alone?

    Not when the runtime's flight record names model code that ran and not this task:
    the task reached a runtime already dying of what the record names, whose own calls
    had ended just before this one began (so nothing else was "in flight" with it). A
    record that names nothing (a crash on the event loop, in ``preprocess``) or none at
    all (an in-process runtime, a record not read) leaves the charge as it was."""
    if not alone or record is None or not record.models:
        return alone
    return record.suspects(task.model_id, task.request_id)


class _NowQuarantined(Exception):
    """A task taken for a shared runtime whose model goes to quarantine now."""


class _Crashed(Exception):
    """A runtime crash under a task: whether the task was alone on the runtime, and what
    the runtime's flight record named."""

    def __init__(self, error: RuntimeCrashed, alone: bool,
                 record: Flight | None = None) -> None:
        super().__init__(str(error))
        self.error = error
        self.alone = alone
        self.record = record  # the models its flight record named (None: unknown)
