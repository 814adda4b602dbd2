"""The demand announcements pull-affinity's simulated workers hear, and what each
worker's coordinator takes of them: the shared log of announcements, each worker's
fold of it into the queues to count afresh (``dirty``), and the wakes they cause.

``PullAnnouncements`` is the base of ``modelfleet.sim.pull.PullAffinity``: it declares
the state the simulator's parts share (``PullAffinity.__init__`` sets it) and holds
what the coordinator's event listener (``_listen_events``) does with an announcement.
"""

from __future__ import annotations

from array import array
from collections import deque
from collections.abc import Iterable

from modelfleet.scheduling import QueueFacts, ScoringSettings
from modelfleet.sim.engine import Simulation
from modelfleet.sim.lane import ColdLane
from modelfleet.sim.pull_state import Consumer, Coordinator
from modelfleet.sim.wakeable import WakeableWorkers
from modelfleet.sim.worker import Task


class PullAnnouncements:
    """The announcements heard, as every worker's coordinator takes them."""

    # The simulator's state, set by PullAffinity.__init__ (which says what each holds).
    settings: ScoringSettings
    rng_seed: int
    # The simulation, set by attach() (a plain attribute, not a property that checks it
    # was: it is read several times per event).
    sim: Simulation
    _queues: list[deque[Task]]
    _nonempty: set[int]
    _consumers: list[list[Consumer]]
    _coords: list[Coordinator]
    _demand: dict[int, float]
    _demand_log: deque[tuple[float, int]]
    _demand_moves: list[int]
    _demand_moves_offset: int
    _heard_log: list[int]
    _heard_offset: int
    _heard_at: dict[int, int]
    _heard_before: array[int]
    _names: tuple[str, ...]
    _facts: list[QueueFacts]
    _cap: list[int]
    _fanout_caps: list[int]
    _qstate: list[tuple[int, int]]
    _backlog_in_demand: dict[int, tuple[int, int]]
    _consumed: set[int]
    _capped: set[int]
    _wakeable: WakeableWorkers
    _queued: set[int]
    _lane: ColdLane | None


    def _wake(self, coord: Coordinator) -> None:
        """Wake ``coord``'s re-score loop (``PullAffinity._wake``)."""
        raise NotImplementedError

    def _heard(self, model: int) -> None:
        """Every worker's event listener gets a demand announcement, and takes it as the
        coordinator's ``_listen_events`` does: a model it does not pull, not already to be
        counted (``dirty``) and not last counted at its fan-out cap is to be counted
        afresh at the next re-score, and wakes it if a permit is free. Once per model
        until it is counted: gateways re-announce every model with a request waiting,
        and in a fleet most of them are other workers' to serve.

        A worker folds what it heard into ``dirty`` from the log when it next needs it
        (``_fold_heard``). Whether ``model`` is dirty already needs no fold: it is if it
        is in ``dirty``, or if it was heard since the worker's last fold and passed then,
        which it did if it passes now (nothing the test reads changed since that fold)."""
        now = self.sim.now
        if model not in self._demand:
            self._demand_moves.append(model)
            if model in self._nonempty:
                self._backlog_in_demand[model] = self._qstate[model]
        self._demand[model] = now
        self._demand_log.append((now, model))
        log = self._heard_log
        before = self._heard_at.get(model, -1)  # its previous entry in the log
        if self.sim.config.event_rescores:
            coords = self._coords
            # Those with a free permit, in worker order; one paused before a re-score, or
            # re-scoring and due to again, would not change (_wake): not asked. Nor one
            # that has not folded since the model's previous entry (before >= its
            # heard_upto, below): the wakeable are kept in the order of their heard_upto.
            asked = self._wakeable.heard_after(before)
            for index in asked:
                coord = coords[index]
                if model in coord.consumers:
                    continue  # a held queue is counted anyway
                if before >= coord.heard_upto or model in coord.at_cap or (
                        before >= coord.dirty_from and model not in coord.not_taken):
                    continue  # to be counted already (if it passes now, it passed then)
                self._wake(coord)  # (before < heard_upto: in dirty iff before >= dirty_from)
        self._heard_at[model] = self._heard_offset + len(log)
        log.append(model)
        self._heard_before.append(before)

    def _fold_heard(self, coord: Coordinator) -> None:
        """Announcements heard since the last fold, each taken as ``_heard`` describes:
        those of models not pulled here and not last counted at their fan-out cap are
        dirty. Exact, not an approximation of taking each when heard: everything this
        reads (the consumers, the counts) is folded before it changes (``_subscribed``,
        ``_unsubscribe``, ``_count``, and ``_gather`` before a ``_set_count``), so it
        reads what was there when each was heard."""
        upto = coord.heard_upto
        end = self.heard_end()
        if upto == end:
            return
        coord.heard_upto = end
        self._wakeable.folded(coord.worker.index, end)
        # Heard since upto: those held here or at the cap are not taken now; the others
        # are dirty, whatever they were. What was not taken stays so unless heard again
        # and taken; one not taken now stays dirty if it was already.
        # From the stretch heard when it is the shorter (a small fleet, where many
        # queues sit at their cap), else from those held or at the cap (a large one).
        not_taken = coord.not_taken
        if end - upto <= len(coord.consumers) + len(coord.at_cap) + len(not_taken):
            offset = self._heard_offset
            heard = set(self._heard_log[upto - offset:])
            # set.difference walks the few heard, asking the others ("-" with dict
            # keys, and "-=", would walk every consumer and every queue at its cap).
            taken = heard.difference(coord.consumers).difference(coord.at_cap)
            not_taken -= taken
            skipped: Iterable[int] = heard - taken
        else:
            heard_at = self._heard_at
            skip = coord.consumers.keys() | coord.at_cap
            not_taken = coord.not_taken = {m for m in not_taken
                                           if heard_at[m] < upto or m in skip}
            skipped = [m for m in skip if heard_at.get(m, -1) >= upto]
        for m in skipped:
            if not self._heard_within(m, coord.dirty_from, upto):
                not_taken.add(m)

    def _heard_within(self, model: int, start: int, end: int) -> bool:
        """Is an announcement of ``model`` in ``_heard_log[start:end]``?"""
        position = self._heard_at.get(model, -1)
        before, offset = self._heard_before, self._heard_offset
        while position >= end:
            position = before[position - offset]
        return position >= start

    def heard_end(self) -> int:
        """The position the next announcement heard takes in the log."""
        return self._heard_offset + len(self._heard_log)

    def _trim_heard(self) -> None:
        """Drop the announcements before every worker's ``dirty_from`` (no worker reads
        them again: a fold reads from its ``heard_upto``, a dirty set from its
        ``dirty_from``) once they are half the log: a fleet's gateways announce every
        model with a request waiting four times a second."""
        start = min((coord.dirty_from for coord in self._coords), default=0)
        drop = start - self._heard_offset
        if drop > len(self._heard_log) // 2:
            del self._heard_log[:drop]
            del self._heard_before[:drop]
            self._heard_offset = start

    def dirty(self, coord: Coordinator) -> set[int]:
        """The queues ``coord`` is to count afresh at its next woken re-score: heard since
        its last count (as folded), neither held here nor at the cap when heard."""
        offset = self._heard_offset
        # A woken re-score asks twice (what to count, then the counts): the models heard
        # up to the first ask are kept until the count, and only what came since is read.
        heard_upto, heard = coord.heard_cache
        if heard is None:
            heard = set(self._heard_log[coord.dirty_from - offset:coord.heard_upto - offset])
        elif heard_upto < coord.heard_upto:
            heard.update(self._heard_log[heard_upto - offset:coord.heard_upto - offset])
        coord.heard_cache = (coord.heard_upto, heard)
        return heard - coord.not_taken

    def _forget_dirty(self, coord: Coordinator) -> None:
        coord.dirty_from = coord.heard_upto
        coord.not_taken = set()
        coord.heard_cache = (0, None)
