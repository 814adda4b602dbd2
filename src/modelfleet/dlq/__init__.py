"""The dead-letter pipeline: archive, classify, list and replay what the broker gave up on.

Dead letters are not a graveyard. ``modelfleet dlq archive`` consumes the broker's
dead-letter queue into an ``Archive`` (SQLite or PostgreSQL), classifying each
death as *transient* (the input had nothing to do with it) or *deterministic* (it
would die the same way again) under a normalised *failure signature*. ``list``
shows them, grouped by signature if asked; ``replay`` republishes transient ones
and prints each outcome; deterministic ones are replayed only when named by hand.

Modules: ``classify`` (pure rules), ``records`` (what is kept, how a new death
updates it), ``archive`` (storage: the protocol, ``sqlite``, ``postgres``, ``statements``
and ``backend`` shared by both), ``consumer`` (the consumer loop; ``embedded`` runs it in
``serve``), ``replay``, ``render`` and ``cli``. See docs/dlq.md.
"""

from modelfleet.dlq.archive import Archive, ArchiveError, ArchiveUnavailable, open_archive
from modelfleet.dlq.classify import Classification, FailureClass, classify, failure_signature
from modelfleet.dlq.records import DeadLetterRecord, Selection, SignatureCount
from modelfleet.dlq.replay import ReplayRefused

__all__ = [
    "Archive",
    "ArchiveError",
    "ArchiveUnavailable",
    "Classification",
    "DeadLetterRecord",
    "FailureClass",
    "ReplayRefused",
    "Selection",
    "SignatureCount",
    "classify",
    "failure_signature",
    "open_archive",
]
