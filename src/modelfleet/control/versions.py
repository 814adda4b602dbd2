"""Which version the unversioned route of a model serves, and what a worker does about it.

Pure: no broker, no clock of its own. The gateway and the worker run the same rule
over the same announcements, so they agree on the route (each a moment apart).

The route of a model (``route``):

1. an operator's load of a named version put that version on it: that one;
2. otherwise the newest version in the repository that no worker failed to load and
   that every worker holding the model (any version) holds: a new version takes the
   route only once it is warm wherever the old one is;
3. no worker holds the model: the newest version that no worker failed to load (or
   the good version the caller routed it to a moment ago: ``sticky``).

A worker (``plan``) warms the newest version where it holds an older one (a pinned
model's versions are kept on every worker by its ``PinKeeper``), unpins a version as
soon as the route left it, and releases it once the route has left it for ``drain_s``
(tasks stamped with it before the switch still arrive meanwhile).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

Versions = Mapping[str, frozenset[str]]  # model id -> versions


@dataclass(frozen=True)
class Holdings:
    """What one worker announced, by model: versions resident (device or host), versions
    that failed to load there, versions its runtimes hold pinned."""

    worker_id: str
    resident: Versions = field(default_factory=dict)
    failed: Versions = field(default_factory=dict)
    pinned: Versions = field(default_factory=dict)


def route(model_id: str, versions: Sequence[str], explicit: str | None,
          fleet: Iterable[Holdings], sticky: str | None = None) -> str:
    """The version unversioned requests for ``model_id`` are stamped with.

    ``versions``: the repository's versions of the model, oldest first (never empty).
    ``sticky``: the version this caller routed the model to a moment ago, kept while no
    worker is known to hold the model: announcements lag a model a request has just
    loaded, and without it a new version appearing in that moment would be routed to
    (and loaded cold) before any worker said it holds the old one.
    """
    if explicit is not None and explicit in versions:
        return explicit
    fleet = list(fleet)
    failed = frozenset().union(*(h.failed.get(model_id, frozenset()) for h in fleet))
    candidates = [v for v in reversed(versions) if v not in failed]
    if not candidates:  # every version failed somewhere: the newest, whose error answers
        return versions[-1]
    holders = [h.resident[model_id] for h in fleet if h.resident.get(model_id)]
    if not holders:
        return sticky if sticky in candidates else candidates[0]
    for version in candidates:
        if all(version in held for held in holders):
            return version
    # Holders share no good version (one holds an old one, another a newer one being
    # warmed): the newest one held anywhere, so that no request waits for a load.
    anywhere = frozenset().union(*holders)
    return next((v for v in candidates if v in anywhere), candidates[0])


def newest_good(versions: Sequence[str], explicit: str | None,
                failed: frozenset[str]) -> str | None:
    """The version a worker rolls towards: the operator's, else the newest not failed here."""
    if explicit is not None and explicit in versions:
        return explicit
    return next((v for v in reversed(versions) if v not in failed), None)


def pin_versions(route_version: str, newest: str | None) -> list[str]:
    """The versions of a pinned model kept loaded: its route's and the one rolling in."""
    return [route_version] + ([newest] if newest and newest != route_version else [])


@dataclass(frozen=True)
class Warm:
    model_id: str
    version: str
    pinned: bool


@dataclass(frozen=True)
class Plan:
    warm: tuple[Warm, ...] = ()
    unpin: tuple[tuple[str, str], ...] = ()  # (model id, version)
    release: tuple[tuple[str, str], ...] = ()
    unload: tuple[str, ...] = ()  # models an operator unloaded that are still resident


@dataclass(frozen=True)
class ModelView:
    """One model as a worker sees it when it plans."""

    model_id: str
    versions: tuple[str, ...]  # the repository's, oldest first
    route: str  # as ``route`` says, over the whole fleet
    loaded: bool  # False: an operator unloaded it
    pinned: bool
    explicit: str | None  # the version an operator's load put on the route
    resident: frozenset[str]  # versions resident on this worker
    pinned_here: frozenset[str]  # versions this worker's runtimes hold pinned
    loading: frozenset[str]  # versions being loaded here (by this plan's earlier steps)
    failed: frozenset[str]  # versions not to warm here: broken, or pausing after an error
    superseded_s: Mapping[str, float]  # version -> seconds since the route left it


def plan(models: Iterable[ModelView], drain_s: float) -> Plan:
    warm: list[Warm] = []
    unpin: list[tuple[str, str]] = []
    release: list[tuple[str, str]] = []
    unload: list[str] = []
    for m in models:
        if not m.loaded:
            if m.resident:
                unload.append(m.model_id)
            continue
        newest = newest_good(m.versions, m.explicit, m.failed)
        wanted = pin_versions(m.route, newest) if m.pinned else \
            [newest] if m.resident and newest is not None else []
        if not m.pinned:  # pinned versions are kept loaded by the worker's PinKeeper
            warm.extend(Warm(m.model_id, v, False) for v in wanted
                        if v not in m.resident and v not in m.loading and v not in m.failed)
        for version in sorted(m.resident):
            if version == m.route or version in wanted:
                continue
            left_s = m.superseded_s.get(version)
            if left_s is None:
                continue  # never the route here: loaded on demand, evicted as usual
            if version in m.pinned_here:
                unpin.append((m.model_id, version))
            if left_s >= drain_s:
                release.append((m.model_id, version))
        if not m.pinned:
            for version in sorted(m.pinned_here & m.resident):
                if (m.model_id, version) not in unpin:
                    unpin.append((m.model_id, version))  # an operator unpinned it
    return Plan(tuple(warm), tuple(unpin), tuple(release), tuple(unload))
