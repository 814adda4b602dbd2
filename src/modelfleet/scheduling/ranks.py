"""The order workers agree on for one model's queue, without a word between them. Pure.

``keep_rank`` ranks every worker alike on every worker (rendezvous hashing over the
model and worker ids). Over a queue with more consumers than its fan-out cap the
lowest ranks keep it (``scoring.choose_queues``); before a cold take of a capped queue
a worker waits its ``take_turn`` behind the free workers ranked ahead of it (the
coordinator's ``_my_turn``).
"""

from __future__ import annotations

import functools
import hashlib


@functools.lru_cache(maxsize=1 << 16)
def keep_rank(worker_id: str, model_id: str) -> bytes:
    """Where ``worker_id`` stands among the consumers of ``model_id``'s queue when they
    are more than its fan-out cap: the lowest ranks keep it, the rest step back.

    Rendezvous hashing: every worker computes every other's rank alike (no seed of its
    own), so workers that know the same consumers agree on who steps back, without a
    word between them, and no two of them both leave a queue one of them should keep.
    Across models the ranks are independent, so no worker is everyone's first."""
    return hashlib.blake2b(f"keep\x1f{model_id}\x1f{worker_id}".encode(),
                           digest_size=8).digest()


# A cold take waits at most this many turns (WorkerSettings.cold_take_turn_s each).
MAX_TAKE_TURNS = 3


def take_turn(ahead: int, cap: int) -> int:
    """The turn of a cold take by a worker that ``ahead`` free workers outrank
    (``keep_rank``) on a queue of fan-out cap ``cap``: the best ``cap`` take it
    at once (turn 0), the next ``cap`` one turn later, and so on, at most
    ``MAX_TAKE_TURNS``. Workers that rank alike then take a cold queue one after another,
    each after a fresh count, instead of all in the instant an announcement reached them."""
    return min(ahead // max(cap, 1), MAX_TAKE_TURNS)
