"""What a simulated coordinator counts and gathers for a re-score: the broker's counts
of its candidate queues (every candidate at a tick, what was announced since and the
held queues with a backlog when woken), its runtimes' stats, and the candidates that
can matter to the decision, with the checks that let a woken re-score skip gathering
again when nothing it reads has moved.

``PullGathering`` is a base of ``modelfleet.sim.pull.PullAffinity`` (its state is
declared in ``modelfleet.sim.pull_heard``).
"""

from __future__ import annotations

import math
from collections.abc import Set as AbstractSet
from typing import cast

from modelfleet.scheduling import candidates, keep_rank
from modelfleet.scheduling.scoring import COLD_WINDOW_S
from modelfleet.sim.pull_heard import PullAnnouncements
from modelfleet.sim.pull_state import Coordinator


class PullGathering(PullAnnouncements):
    """Counting, the runtimes' stats, and gathering the candidates that can matter."""

    def _refresh(self, coord: Coordinator) -> None:
        """What the runtimes' ``stats`` say: device, host, and loading per runtime. What
        did not change since the last stats keeps its objects (the decision's key
        compares them first by identity)."""
        runtimes = coord.worker.runtimes
        old_device, old_host, old_loading = coord.residency
        old_device_names, old_host_names = coord.residency_names
        # No reserve or commit on any runtime's cache since the last stats: the same ids.
        stamps = [runtime.cache_changes for runtime in runtimes]
        if stamps == coord.cache_stamps:
            device, host = old_device, old_host
            device_names, host_names = old_device_names, old_host_names
        else:
            coord.cache_stamps = stamps
            device, host, device_names, host_names = self._resident(coord)
        loading = [set(runtime.loading) for runtime in runtimes]
        if loading == old_loading:
            loading = old_loading
        if device is not old_device or host is not old_host or loading is not old_loading:
            coord.version += 1
        coord.residency = (device, host, loading)
        coord.residency_names = (device_names, host_names)
        coord.refreshed_at = self.sim.now

    def _resident(self, coord: Coordinator
                  ) -> tuple[set[int], set[int], frozenset[str], frozenset[str]]:
        """Device and host residents of the runtimes' caches (indices, then names); the
        last stats' objects where they did not change."""
        ids = [runtime.cache.resident_ids() for runtime in coord.worker.runtimes]
        if len(ids) == 1:
            device_names, host_names = ids[0]
        else:
            device_names = frozenset().union(*(d for d, _ in ids))
            host_names = frozenset().union(*(h for _, h in ids))
        old_device, old_host, _ = coord.residency
        old_device_names, old_host_names = coord.residency_names
        index_of = self.sim.index_of
        if device_names == old_device_names:
            device, device_names = old_device, old_device_names
        else:
            device = {index_of[n] for n in device_names}
        if host_names == old_host_names:
            host, host_names = old_host, old_host_names
        else:
            host = {index_of[n] for n in host_names}
        return device, host, device_names, host_names


    def _expire_demand(self) -> None:
        sim = self.sim
        horizon = sim.now - sim.config.demand_window_s
        log = self._demand_log
        while log and log[0][0] < horizon:
            seen, model = log.popleft()
            if self._demand.get(model) == seen:
                del self._demand[model]
                self._backlog_in_demand.pop(model, None)
                self._demand_moves.append(model)


    def _gathering_stands(self, coord: Coordinator, window: int) -> bool:
        """Would ``_gather`` gather the same as last time? Yes if nothing it reads of this
        worker changed (``coord.version``), the noise window is the same, and no model
        that entered or left the demand since is one whose place in the demand it reads:
        gathered last time, loading or running here, or, when it looked at cold queues,
        last counted with a backlog (``_gather`` asks the demand of no other: it keeps
        the backlogged ones in the demand as cold, and skips those gathered and never
        counted that are in it). Those last counted with a backlog are the same while
        the version is: a recount that moves a backlog bumps it (``_moves_gathering``)."""
        placed = self.sim.placement.moves(coord.worker)
        if placed != coord.placement_moves:  # a model's runtime may have changed
            coord.placement_moves = placed
            coord.version += 1
        if coord.gathered is None:
            return False
        version, demand_at, gathered_window = coord.gathered
        if version != coord.version or gathered_window != window:
            return False
        moves = self._demand_moves
        start = demand_at - self._demand_moves_offset
        if start == len(moves):
            return True
        moved = set(moves[start:])
        if not (moved.isdisjoint(coord.gathered_models)
                and moved.isdisjoint(coord.worker.running)
                and all(moved.isdisjoint(loading) for loading in coord.residency[2])):
            return False
        if not coord.gathered_cold:
            return True  # without a loader's room, _gather looks at no cold queue
        counts, empty = coord.counts, coord.empty
        return not any(model in counts and model not in empty for model in moved)

    def _demand_moves_end(self) -> int:
        """The position the next model to enter or leave the demand takes."""
        return self._demand_moves_offset + len(self._demand_moves)

    def _trim_demand_moves(self) -> None:
        """Drop the demand's moves before every worker's last gathering (none reads
        them again) once they are half the list."""
        start = min((coord.gathered[1] for coord in self._coords if coord.gathered),
                    default=self._demand_moves_end())
        drop = start - self._demand_moves_offset
        if drop > len(self._demand_moves) // 2:
            del self._demand_moves[:drop]
            self._demand_moves_offset = start


    def _observed_key(self, coord: Coordinator, counted: dict[int, tuple[int, int]]
                      ) -> tuple[object, ...]:
        """What a decision depends on besides the instant: the observation's fields that
        change (the others are fixed per worker and model), by model index, the noise
        window, and how many tasks this worker has finished (``last_served`` is updated
        in place). Equal keys, equal observations (``_observation_of``) but for ``now``."""
        worker = coord.worker
        device, host, seen_loading = coord.residency
        return (math.floor(self.sim.now / self.settings.noise_hold_s), worker.served,
                counted, worker.subscriptions, device, host, seen_loading,
                dict(worker.running), tuple(worker.recent_cold), worker.free_permits,
                coord.windows,  # replaced, never changed in place
                self.sim.placement.moves(worker))  # equal, the same runtime per model

    def _own(self, coord: Coordinator) -> set[int]:
        """The candidates that are not there by demand alone: held, resident, pinned.
        The last ones found while the objects they were found from stand: the worker's
        subscriptions are replaced with every change of its consumers (``_subscribed``,
        ``_unsubscribe``), the residents with every change of the stats (``_refresh``)."""
        device, host, _ = coord.residency
        subscriptions = coord.worker.subscriptions
        made = len(self._queued)
        memo = coord.own_of
        if memo is not None and memo[0] is subscriptions and memo[1] is device \
                and memo[2] is host and memo[3] == made:
            return memo[4]
        pinned = self.sim.catalog.pinned
        own = candidates((), coord.consumers, device, host, pinned)
        if self._lane is not None:
            # A model a lane task brought here has a queue only if a task was published
            # there; the worker counts no other (QueueCounts.presume_missing): such a
            # resident is no candidate (it would be subscribed to warm, an empty queue).
            queued, held = self._queued, coord.consumers
            own = {m for m in own if m in queued or m in held or m in pinned}
        coord.own_of = (subscriptions, device, host, made, own)
        return own

    def _candidate_count(self, coord: Coordinator) -> int:
        """How many queues ``scheduling.candidates`` gives the coordinator (every runtime
        here takes work): those announced within the window, plus its own."""
        own = coord.own
        end = self._demand_moves_end()
        memo = coord.own_outside_demand
        if memo is not None and memo[0] is own and not self._moved_since(own, memo[1]):
            outside = memo[2]  # the same own candidates, none of them in or out since
        else:
            # set.difference takes a dict as it is (a lookup per own candidate).
            outside = len(own.difference(self._demand))
        coord.own_outside_demand = (own, end, outside)
        return len(self._demand) + outside

    def _moved_since(self, models: set[int], position: int) -> bool:
        """Did any of ``models`` enter or leave the demand from ``position`` on? (True if
        that stretch was trimmed.)"""
        start = position - self._demand_moves_offset
        if start < 0:
            return True
        return any(model in models for model in self._demand_moves[start:])

    @staticmethod
    def _backlogged(coord: Coordinator, models: AbstractSet[int]) -> set[int]:
        """Those of ``models`` last counted with a backlog."""
        found = models & coord.counts.keys()
        return found - coord.empty  # (set.__sub__ walks the smaller; -= walks empty)

    def _set_count(self, coord: Coordinator, model: int) -> tuple[int, int]:
        """Count ``model``'s queue now (the broker's answer) and keep it as last counted.
        The caller has folded what was heard (``_fold_heard``): it was heard by the
        counts before this one."""
        count = (len(self._queues[model]), len(self._consumers[model]))
        if coord.counts.get(model) != count:
            coord.version += 1
        coord.counts[model] = count
        self._note_count(coord, model, count)
        return count

    def _note_count(self, coord: Coordinator, model: int, count: tuple[int, int]) -> None:
        """Keep ``coord``'s exceptions of its counts (``at_cap``, ``empty``, ``fed``) for
        ``model``, now counted as ``count``: each is a function of the count alone."""
        if count[1] >= self._cap[model]:
            coord.at_cap.add(model)
        else:
            coord.at_cap.discard(model)
        if count[0] > 0:
            coord.empty.discard(model)
            if count[1] == 0:
                coord.fed.discard(model)
            else:
                coord.fed.add(model)
        else:
            coord.empty.add(model)
            coord.fed.discard(model)

    def _count(self, coord: Coordinator, full: bool) -> None:
        """The broker's counts, as the coordinator asks for them: every candidate at a
        tick (but an empty queue in demand only, which cannot change the decision), else
        what was announced since and the held queues last seen with a backlog."""
        if not coord.residency[2]:  # never asked yet
            self._refresh(coord)
        demand = self._demand
        if full:
            # Every candidate is counted now: what was folded into dirty before this
            # re-score began is forgotten, what was heard since is dirty (by the counts
            # it was heard with, so folded before they are replaced).
            self._forget_dirty(coord)
            self._fold_heard(coord)
            # What _set_count does per model, over the sets at once (_qstate, _nonempty,
            # _consumed and _capped say what a count says now): this runs per worker per
            # tick over every candidate.
            old = coord.counts
            own = self._own(coord)
            # The backlogged in demand, as counted now, are the broker's one table of them
            # (_backlog_in_demand): a copy, not a count per queue per worker.
            counts = coord.counts = self._backlog_in_demand.copy()
            qstate = self._qstate
            counts.update(zip(own, map(qstate.__getitem__, own), strict=True))
            now_counted = counts.keys()
            coord.at_cap = now_counted & self._capped
            # The counted beyond own are all backlogged (of _nonempty).
            coord.empty = own - self._nonempty
            coord.fed = (now_counted & self._consumed) & self._nonempty
            # empty and fed follow from the counts: equal counts, nothing changed.
            if counts != old:
                coord.version += 1
            return
        self._fold_heard(coord)  # what was heard while the stats were asked, too
        # What _set_count does, over a set at once: this runs per worker per announcement.
        counted = self.dirty(coord) & demand.keys()
        counted.update(coord.held_backlog & coord.consumers.keys())  # held, last with backlog
        if not counted:  # nothing to count: the sets below stay as they are
            self._forget_dirty(coord)
            return
        # Only a count that moved moves what follows from it (at_cap, empty, fed are each
        # a function of a model's count): most recounts find the same counts.
        counts = coord.counts
        qstate = self._qstate
        moved = [model for model in counted if counts.get(model) != qstate[model]]
        if moved:
            last = list(map(counts.get, moved))
            fresh = list(map(qstate.__getitem__, moved))
            if self._moves_gathering(coord, moved, last, fresh):
                coord.version += 1
            for model, after in zip(moved, fresh, strict=True):
                counts[model] = after
                self._note_count(coord, model, after)
        self._forget_dirty(coord)

    @staticmethod
    def _moves_gathering(coord: Coordinator, models: list[int],
                         last: list[tuple[int, int] | None],
                         fresh: list[tuple[int, int]]) -> bool:
        """Can these recounts (``models``, from ``last`` to ``fresh``) change what the
        next ``_gather`` gathers, so what it decides on? Only through a model it gathered
        last time, or, when it looked at cold queues (a loader had room), through a
        queue with a backlog before or after (what makes one cold, fed or starved, and
        ranks the starved). A queue that stays empty and was not gathered is not read
        (the other counts' changes, and the rest of what ``_gather`` reads, bump
        ``coord.version`` themselves)."""
        gathered = coord.gathered_models
        looked_cold = coord.gathered_cold
        for model, before, after in zip(models, last, fresh, strict=True):
            if before == after:
                continue
            if model in gathered:
                return True
            if looked_cold and (after[0] > 0 or (before is not None and before[0] > 0)):
                return True
        return False


    def _gather(self, coord: Coordinator) -> dict[int, tuple[int, int]]:
        """The candidates' counts the observation carries, by model index.

        Of the candidates (scheduling.candidates), only those that can matter
        (scheduling.cannot_matter): held, warm here (device, host, pinned, loading) or
        last counted with a backlog. snapshot_of leaves the others out itself, so the
        snapshot is the same; this keeps the gathering O(what matters), not O(demand).
        A cold queue (not own, not loading here) on a runtime whose loader has no free
        slot cannot matter either (snapshot_of drops it): the loader's room is what
        worker_view makes of the stats' loading and the tasks running off the device.
        Nor can starved cold queues (nothing consumes them, as last counted) beyond a
        runtime's free slots: snapshot_of keeps the best ``room`` of them by scoring's
        own rank; so does this, from fewer views."""
        worker = coord.worker
        device, _, seen_loading = coord.residency
        counts = coord.counts
        demand = self._demand
        own = coord.own = self._own(coord)
        runtime_of = self.sim.placement.homes(worker)
        busy = [set(models) for models in seen_loading]
        for m in worker.running:
            if m not in device:
                busy[runtime_of[m]].add(m)
        room = [r.loaders - len(b) for r, b in zip(worker.runtimes, busy, strict=True)]
        gather = set(own)
        for models in busy:
            gather.update(m for m in models if m in demand or m in own)
        coord.gathered_cold = any(slots > 0 for slots in room)
        if coord.gathered_cold:
            cold = self._backlogged(coord, demand.keys())
            cold -= gather  # own, and loading here in demand
            for models in busy:
                cold -= models
            starved = cold - coord.fed
            cold &= coord.fed
            if len(room) == 1:
                gather |= cold
                self._claimable(coord, starved, room[0], gather)
            else:
                by_runtime: list[set[int]] = [set() for _ in room]
                for m in starved:
                    by_runtime[runtime_of[m]].add(m)
                gather.update(m for m in cold if room[runtime_of[m]] > 0)
                for slots, waiting in zip(room, by_runtime, strict=True):
                    if slots > 0:
                        self._claimable(coord, waiting, slots, gather)
        coord.gathered_models = gather
        gathered = list(gather)
        found = list(map(counts.get, gathered))
        counted: dict[int, tuple[int, int]]
        if None in found:
            self._fold_heard(coord)  # before _set_count changes the counts
            counted = {}
            for model, count in zip(gathered, found, strict=True):
                if count is None:
                    if model in demand:
                        continue  # in demand, never counted: an empty queue (see _count)
                    count = self._set_count(coord, model)
                counted[model] = count
        else:
            counted = dict(zip(gathered, cast(list[tuple[int, int]], found), strict=True))
        now = self.sim.now
        while worker.recent_cold and now - worker.recent_cold[0] >= COLD_WINDOW_S:
            worker.recent_cold.popleft()
            coord.version += 1
        return counted


    def _claimable(self, coord: Coordinator, starved: set[int], slots: int,
                   gather: set[int]) -> None:
        """Add to ``gather`` the ``slots`` best of ``starved`` (all of them if no more)."""
        if len(starved) <= slots:
            gather |= starved
            return
        assert coord.ranks is not None
        gather.update(coord.ranks.best(starved, coord.counts, slots, self.sim.now))

    def _outranked_by(self, coord: Coordinator, counted: dict[int, tuple[int, int]]
                      ) -> dict[str, int]:
        """Observation.outranked_by: per held queue over its cap, the other consumers
        ranked ahead of this worker (the simulated fleet knows them all at once)."""
        over: dict[str, int] = {}
        caps = self._fanout_caps
        for model in coord.consumers:
            count = counted.get(model)
            if count is None or count[1] <= caps[model]:
                continue
            model_id = self._names[model]
            mine = keep_rank(coord.worker.name, model_id)
            over[model_id] = sum(
                1 for c in self._consumers[model] if c.owner != coord.worker.index
                and keep_rank(self._coords[c.owner].worker.name, model_id) < mine)
        return over
