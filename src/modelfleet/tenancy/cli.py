"""modelfleet keys | tenants | usage: API keys, tenants' plans and grants, usage export.

    modelfleet keys create --tenant acme [--role caller|operator|admin] [--plan pro]
    modelfleet keys list [--tenant acme]          prefixes only: a key is shown once
    modelfleet keys revoke mfk_0123456789ab       (or just the 12-hex id)
    modelfleet tenants set acme --plan pro        create, or change the plan
    modelfleet tenants grant acme other-teams-model   [ungrant]
    modelfleet tenants list
    modelfleet usage --tenant acme --since 1h [--until ...] [--model m] [--csv]

Every command takes ``--db`` (default: ``$MODELFLEET_TENANCY__DB``, else the dead-letter
archive's database: ``$MODELFLEET_DLQ_DB`` or ~/.cache/modelfleet/dlq.sqlite3).
Exit codes: 0 done, 1 nothing to do (a key not found), 2 usage or configuration,
4 the store cannot be opened or failed.
"""

from __future__ import annotations

import argparse
import csv
import os
import re
import sys
import time
from datetime import UTC, datetime

from modelfleet.errors import ConfigError, ModelfleetError
from modelfleet.exits import EXIT_CONFIG, EXIT_FAILED
from modelfleet.tenancy import TenancyStoreError, keys
from modelfleet.tenancy.plans import load_plans
from modelfleet.tenancy.store import TenantStore, UsageRow, open_store, store_location

EXIT_STORE = 4
_RELATIVE = re.compile(r"(\d+(?:\.\d+)?)([smhd])")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def _db_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--db", default=store_location(os.environ.get("MODELFLEET_TENANCY__DB",
                                                                      "")),
                        help="a SQLite file or a postgresql:// URL (env MODELFLEET_TENANCY__DB, "
                             "else MODELFLEET_DLQ_DB; default dlq.sqlite3 in "
                             "$MODELFLEET_STATE_DIR, ~/.cache/modelfleet)")


def _plan_flag(parser: argparse.ArgumentParser, required: bool = False) -> None:
    parser.add_argument("--plan", default=None, required=required,
                        help="free, pro, enterprise, or one of the plans file's "
                             "(--plans-file, env MODELFLEET_TENANCY__PLANS_FILE)")
    parser.add_argument("--plans-file", default=os.environ.get("MODELFLEET_TENANCY__PLANS_FILE",
                                                               ""))


def keys_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="modelfleet keys", description="API keys")
    commands = parser.add_subparsers(dest="command", required=True)
    create = commands.add_parser("create", help="make a key; it is printed once, never kept")
    create.add_argument("--tenant", required=True)
    create.add_argument("--role", choices=keys.ROLES, default="caller")
    create.add_argument("--label", default="", help="what the key is for (shown by list)")
    _plan_flag(create)
    listing = commands.add_parser("list", help="keys, by prefix (never the secret)")
    listing.add_argument("--tenant", default=None)
    revoke = commands.add_parser("revoke", help="gateways refuse it within seconds")
    revoke.add_argument("key", help="the key's prefix (mfk_<12 hex>) or id, or the whole key")
    for sub in (create, listing, revoke):
        _db_flag(sub)
    return parser


def tenants_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="modelfleet tenants", description="tenants")
    commands = parser.add_subparsers(dest="command", required=True)
    put = commands.add_parser("set", help="create a tenant, or change its plan")
    put.add_argument("tenant")
    _plan_flag(put)
    grant = commands.add_parser("grant", help="let a tenant use another tenant's model")
    ungrant = commands.add_parser("ungrant", help="withdraw a grant")
    for sub in (grant, ungrant):
        sub.add_argument("tenant")
        sub.add_argument("model")
    listing = commands.add_parser("list", help="tenants, their plans and grants")
    for sub in (put, grant, ungrant, listing):
        _db_flag(sub)
    return parser


def usage_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="modelfleet usage",
                                     description="usage per tenant, model, hour and outcome")
    parser.add_argument("--tenant", default=None, help="only this tenant (default: all)")
    parser.add_argument("--model", default=None)
    parser.add_argument("--since", default="24h",
                        help="an ISO date or time (UTC unless it says), or an age: 90m, 6h, "
                             "7d (default 24h); rounded down to its hour")
    parser.add_argument("--until", default=None, help="like --since; default: now")
    parser.add_argument("--csv", action="store_true", help="CSV with a header row")
    _db_flag(parser)
    return parser


def parse_when(text: str, now_s: float) -> int:
    """Epoch ms of ``text``: an age (``6h``) before ``now_s``, or an ISO date/time."""
    match = _RELATIVE.fullmatch(text.strip())
    if match:
        return int((now_s - float(match.group(1)) * _UNIT_S[match.group(2)]) * 1000)
    try:
        when = datetime.fromisoformat(text.strip())
    except ValueError:
        raise ConfigError(f"cannot read {text!r} as a time: give an age (90m, 6h, 7d) or an "
                          "ISO date or time (2026-11-30, 2026-11-30T18:00)") from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return int(when.timestamp() * 1000)


def _hour(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, UTC).strftime("%Y-%m-%dT%H:00Z")


USAGE_HEADER = ("hour", "tenant", "model", "outcome", "requests", "predict_s", "load_s",
                "bytes_in", "bytes_out")


def _usage_fields(row: UsageRow) -> tuple[str, ...]:
    return (_hour(row.hour_ms), row.tenant, row.model, row.outcome, str(row.requests),
            f"{row.predict_s:.3f}", f"{row.load_s:.3f}", str(row.bytes_in), str(row.bytes_out))


def _checked_plan(plan: str | None, plans_file: str) -> str | None:
    if plan is not None and plan not in load_plans(plans_file):
        raise ConfigError(f"no plan named {plan!r}: free, pro, enterprise, or one of the "
                          "plans file's (--plans-file)")
    return plan


def _keys(args: argparse.Namespace, store: TenantStore) -> int:
    if args.command == "create":
        record, token = store.create_key(args.tenant, args.role, args.label,
                                         _checked_plan(args.plan, args.plans_file))
        print(token)
        print(f"key {keys.prefix_of(record.key_id)} for tenant '{record.tenant}', role "
              f"{record.role}: this is the only time it is shown", file=sys.stderr)
        return 0
    if args.command == "list":
        print(f"{'key':<22} {'tenant':<20} {'role':<9} {'created (UTC)':<17} {'revoked':<17} "
              "label")
        for rec in store.keys(args.tenant):
            created = datetime.fromtimestamp(rec.created_ms / 1000, UTC)
            revoked = ("-" if rec.revoked_ms is None else
                       datetime.fromtimestamp(rec.revoked_ms / 1000, UTC).strftime(
                           "%Y-%m-%d %H:%M"))
            print(f"{keys.prefix_of(rec.key_id):<22} {rec.tenant:<20} {rec.role:<9} "
                  f"{created:%Y-%m-%d %H:%M}  {revoked:<17} {rec.label}")
        return 0
    key_id = _key_id(args.key)
    if store.revoke(key_id):
        print(f"revoked {keys.prefix_of(key_id)}: gateways refuse it within seconds")
        return 0
    known = store.key(key_id)
    print(f"modelfleet keys: {keys.prefix_of(key_id)} "
          f"{'was revoked already' if known else 'is not a key in ' + store.location}",
          file=sys.stderr)
    return EXIT_FAILED


def _key_id(text: str) -> str:
    """The key id in a prefix as ``list`` shows it, a bare id, or a whole key."""
    match = re.fullmatch(r"(?:mfk_)?([0-9a-f]{12})(?:_.*)?", text.strip().rstrip("…"))
    if match is None:
        raise ConfigError(f"{text!r} is not a key prefix: give mfk_<12 hex digits> as "
                          "'modelfleet keys list' shows it")
    return match.group(1)


def _tenants(args: argparse.Namespace, store: TenantStore) -> int:
    if args.command == "set":
        tenant = store.set_tenant(args.tenant, _checked_plan(args.plan, args.plans_file))
        print(f"tenant '{tenant.name}': plan {tenant.plan}")
    elif args.command == "grant":
        store.grant(args.tenant, args.model)
        print(f"tenant '{args.tenant}' may use model '{args.model}'")
    elif args.command == "ungrant":
        if not store.ungrant(args.tenant, args.model):
            print(f"modelfleet tenants: '{args.tenant}' had no grant of '{args.model}'",
                  file=sys.stderr)
            return EXIT_FAILED
        print(f"tenant '{args.tenant}' may no longer use model '{args.model}'")
    else:
        for tenant in store.tenants():
            print(f"{tenant.name:<24} {tenant.plan:<12} {', '.join(sorted(tenant.grants))}")
    return 0


def _usage(args: argparse.Namespace, store: TenantStore) -> int:
    now_s = time.time()
    since = parse_when(args.since, now_s)
    until = parse_when(args.until, now_s) if args.until else None
    rows = store.usage(args.tenant, since, until, args.model)
    if args.csv:
        out = csv.writer(sys.stdout, lineterminator="\n")
        out.writerow(USAGE_HEADER)
        out.writerows(_usage_fields(row) for row in rows)
        return 0
    widths = (17, 16, 16, 12, 9, 10, 10, 11, 11)
    print(" ".join(f"{h:<{w}}" for h, w in zip(USAGE_HEADER, widths, strict=True)))
    for row in rows:
        print(" ".join(f"{v:<{w}}" for v, w in zip(_usage_fields(row), widths, strict=True)))
    if not rows:
        print(f"(no usage since {_hour(since - since % 3_600_000)} in {store.location})",
              file=sys.stderr)
    return 0


def main(command: str, argv: list[str]) -> int:
    parser = {"keys": keys_parser, "tenants": tenants_parser, "usage": usage_parser}[command]()
    args = parser.parse_args(argv)
    run = {"keys": _keys, "tenants": _tenants, "usage": _usage}[command]
    prog = f"modelfleet {command}"
    try:
        store = open_store(args.db)
    except TenancyStoreError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return EXIT_STORE
    except ConfigError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    try:
        return run(args, store)
    except TenancyStoreError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return EXIT_STORE
    except ModelfleetError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return EXIT_CONFIG if isinstance(exc, ConfigError) else EXIT_FAILED
    finally:
        store.close()
