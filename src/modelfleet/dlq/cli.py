"""modelfleet dlq: archive, list, show and replay dead letters.

The edge of the dlq package: settings are built here from flags and the
environment, library code raises typed errors, and this is the one place that
turns them into a message and an exit code:

    0  done (replay: every replayed task answered ok)
    1  replay: some replayed task failed or did not answer
    2  usage or configuration (including the embedded broker, and refused replays)
    3  the broker cannot be reached
    4  the archive cannot be opened or failed
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from dataclasses import asdict
from pathlib import Path

from pydantic import ValidationError

from modelfleet.broker import Broker, create_broker
from modelfleet.database import default_location
from modelfleet.dlq import render
from modelfleet.dlq.archive import Archive, ArchiveError, open_archive
from modelfleet.dlq.classify import FAILURE_CLASSES
from modelfleet.dlq.consumer import archive_dead_letters
from modelfleet.dlq.records import DeadLetterRecord, Selection
from modelfleet.dlq.replay import (
    ReplayOutcome,
    ReplayRequest,
    plan_replay,
    replay,
    replay_through_gateway,
)
from modelfleet.errors import ConfigError, ModelfleetError
from modelfleet.exits import EXIT_CONFIG, EXIT_FAILED, EXIT_INTERRUPTED, report
from modelfleet.settings import BrokerSettings

EXIT_ARCHIVE = 4  # the archive could not be opened or written (see modelfleet.exits)

log = logging.getLogger("modelfleet.dlq")


def _positive(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text} is not a positive number")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="modelfleet dlq", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)

    def add(name: str, help_: str, broker: bool) -> argparse.ArgumentParser:
        sub = commands.add_parser(name, help=help_, description=help_)
        sub.add_argument("--db", default=default_location(),
                         help="archive: a SQLite file or a postgresql:// URL "
                              "(env MODELFLEET_DLQ_DB; default dlq.sqlite3 in "
                              "$MODELFLEET_STATE_DIR, ~/.cache/modelfleet)")
        if broker:
            sub.add_argument("--broker", default=os.environ.get("MODELFLEET_BROKER", "memory"),
                             help="amqp://user:pass@host:port/ (env MODELFLEET_BROKER)")
        return sub

    archive = add("archive", "consume the dead-letter queue into the archive", broker=True)
    archive.add_argument("--once", action="store_true",
                         help="drain what is queued now, then exit (else run until a signal)")
    archive.add_argument("--idle-s", type=float, default=1.0,
                         help="with --once: stop after this long without a dead letter")

    listing = add("list", "list archived dead letters, oldest first", broker=False)
    _selection_flags(listing)
    listing.add_argument("--by-signature", action="store_true",
                         help="count dead letters per failure signature and model instead")
    listing.add_argument("--json", action="store_true", help="one JSON object per line")

    show = add("show", "everything archived about one dead letter, as JSON", broker=False)
    show.add_argument("request_id")
    show.add_argument("--payload-out", type=Path,
                      help="also write its inline payload bytes to this file")

    again = add("replay", "republish archived dead letters and print each outcome", broker=True)
    _selection_flags(again, class_required=True)
    again.add_argument("--request-id", action="append", default=[], dest="request_ids",
                       help="only this one (repeatable); required with --force")
    again.add_argument("--force", action="store_true",
                       help="allow --class deterministic, for the named --request-id only")
    again.add_argument("--include-replayed", action="store_true",
                       help="also those replayed before (default: only never-replayed ones)")
    again.add_argument("--timeout-s", type=float, default=None,
                       help="new deadline, from now (default: each task's original timeout)")
    again.add_argument("--no-wait", action="store_true",
                       help="republish and exit; replies go to the original (gone) gateway")
    again.add_argument("--dry-run", action="store_true",
                       help="print what would be replayed, and republish nothing")
    again.add_argument("--gateway", default=None, metavar="URL",
                       help="send them again through this gateway's HTTP API instead of "
                            "the broker (what 'modelfleet serve' on its embedded broker "
                            "needs; works against any deployment)")
    return parser


def _selection_flags(parser: argparse.ArgumentParser, class_required: bool = False) -> None:
    parser.add_argument("--class", dest="failure_class", choices=FAILURE_CLASSES,
                        required=class_required)
    parser.add_argument("--model", dest="model_id", default=None, help="only this model id")
    parser.add_argument("--limit", type=_positive, default=None, help="at most this many")


def broker_settings(url: str) -> BrokerSettings:
    """``BrokerSettings`` from ``MODELFLEET_BROKER__*`` variables, with ``url`` on top."""
    if url == "memory":
        raise ConfigError(
            "the dlq command needs a broker shared across processes: 'memory' is the embedded "
            "broker that lives inside one 'modelfleet serve' process, so from here there is "
            "nothing to consume or republish to. 'modelfleet serve' archives its dead letters "
            "itself ('modelfleet dlq list' reads them); replay them with 'modelfleet dlq "
            "replay --gateway http://host:port'. For RabbitMQ pass --broker "
            "amqp://user:pass@host:5672/ or set MODELFLEET_BROKER.")
    values: dict[str, str] = {"url": url}
    for name in BrokerSettings.model_fields:
        value = os.environ.get(f"MODELFLEET_BROKER__{name.upper()}")
        if value is not None and name != "url":
            values[name] = value
    try:
        return BrokerSettings.model_validate(values)
    except ValidationError as exc:
        first = exc.errors()[0]
        raise ConfigError(f"setting broker.{'.'.join(map(str, first['loc']))}: "
                          f"{first['msg']}") from exc


def main(argv: list[str]) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:  # argparse: --help, or a usage error it already printed
        return exc.code if isinstance(exc.code, int) else EXIT_CONFIG
    logging.basicConfig(level=os.environ.get("MODELFLEET_LOG_LEVEL", "info").upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return _run(args)
    except ArchiveError as exc:
        print(f"modelfleet dlq: error: {exc}", file=sys.stderr)
        return EXIT_ARCHIVE
    except ModelfleetError as exc:
        return report("modelfleet dlq", exc)
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED


def _run(args: argparse.Namespace) -> int:
    # Check the broker URL before opening anything, so a wrong one costs nothing.
    needs_broker = args.command == "archive" or (
        args.command == "replay" and not args.dry_run and not args.gateway)
    settings = broker_settings(args.broker) if needs_broker else None
    archive = open_archive(args.db)
    try:
        if args.command == "archive":
            assert settings is not None
            return asyncio.run(_archive(create_broker(settings), archive, args))
        if args.command == "list":
            return _list(archive, args)
        if args.command == "show":
            return _show(archive, args)
        return _replay(settings, archive, args)
    finally:
        archive.close()


async def _archive(broker: Broker, archive: Archive, args: argparse.Namespace) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)

    def report(record: DeadLetterRecord, new: bool) -> None:
        verb = "archived" if new else "already archived"
        print(f"{verb}  {record.request_id}  {record.model_id}@{record.version}  "
              f"{record.failure_class}/{record.rule}  {record.signature}", flush=True)

    await broker.connect()
    try:
        stats = await archive_dead_letters(broker, archive, stop, on_record=report,
                                           idle_s=args.idle_s if args.once else None)
    finally:
        await broker.close()
    print(f"{stats.archived} archived, {stats.duplicates} already there, in "
          f"{archive.location}", flush=True)
    return 0


def _list(archive: Archive, args: argparse.Namespace) -> int:
    selection = Selection(failure_class=args.failure_class, model_id=args.model_id,
                          limit=args.limit)
    if args.by_signature:
        counts = archive.signature_counts(selection)
        if args.json:
            for count in counts:
                print(render.json_line(asdict(count)))
        else:
            print(render.counts_table(counts))
        return 0
    records = archive.select(selection)
    if args.json:
        for record in records:
            print(render.json_line(render.record_json(record)))
    else:
        print(render.records_table(records))
    return 0


def _show(archive: Archive, args: argparse.Namespace) -> int:
    record = archive.get(args.request_id)
    if record is None:
        print(f"modelfleet dlq: {args.request_id} is not in {archive.location}", file=sys.stderr)
        return EXIT_FAILED
    data = render.record_json(record)
    data["task"] = {k: v for k, v in asdict(record.task()).items() if k != "payload"}
    print(render.json_line(data))
    if args.payload_out is not None:
        args.payload_out.write_bytes(record.payload_inline)
    return 0


def _replay(settings: BrokerSettings | None, archive: Archive, args: argparse.Namespace) -> int:
    plan = plan_replay(archive, ReplayRequest(
        failure_class=args.failure_class, model_id=args.model_id,
        request_ids=tuple(args.request_ids), limit=args.limit, force=args.force,
        include_replayed=args.include_replayed))
    for request_id, why in plan.skipped:
        print(f"skipped   {request_id}  ({why})")
    if not plan.records:
        print("nothing to replay")
        return 0
    if args.dry_run:
        for record in plan.records:
            print(f"would replay  {record.request_id}  {record.model_id}@{record.version}  "
                  f"{record.failure_class}/{record.rule}  {record.signature}")
        return 0
    timeout_ms = int(args.timeout_s * 1000) if args.timeout_s else None

    def report(outcome: ReplayOutcome) -> None:
        print(render.outcome_line(outcome), flush=True)

    async def run() -> list[ReplayOutcome]:
        if args.gateway:
            return await replay_through_gateway(args.gateway, archive, plan,
                                                timeout_ms=timeout_ms, on_outcome=report)
        assert settings is not None
        broker = create_broker(settings)
        await broker.connect()
        try:
            return await replay(broker, archive, plan, timeout_ms=timeout_ms,
                                wait=not args.no_wait, on_outcome=report)
        finally:
            await broker.close()

    outcomes = asyncio.run(run())
    good = sum(o.status in ("ok", "sent") for o in outcomes)
    sent = args.no_wait and not args.gateway
    print(f"{len(outcomes)} replayed: {good} {'sent' if sent else 'ok'}, "
          f"{len(outcomes) - good} failed or unanswered")
    return 0 if good == len(outcomes) else EXIT_FAILED
