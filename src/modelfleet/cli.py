"""The ``modelfleet`` command: serve, gateway, worker, push, sim, dlq, keys, tenants, usage.

Settings are built here, once, from defaults, ``MODELFLEET_*`` environment variables
and flags, and passed down. Library code raises typed errors; this is the one place
that turns them into a message and an exit code.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from typing import Any

from pydantic import ValidationError

from modelfleet import __version__
from modelfleet.errors import ModelfleetError
from modelfleet.exits import EXIT_CONFIG, EXIT_INTERRUPTED, report
from modelfleet.logformat import configure_logging
from modelfleet.settings import Settings, unknown_settings


def _common(parser: argparse.ArgumentParser, gateway: bool, worker: bool) -> None:
    parser.add_argument("--repo", default=os.environ.get("MODELFLEET_REPO", "examples/models"),
                        help="model repository: a folder or an fsspec URL (env MODELFLEET_REPO)")
    parser.add_argument("--broker", default=None,
                        help="'memory' (embedded) or amqp://user:pass@host:port/ "
                             "(env MODELFLEET_BROKER)")
    parser.add_argument("--log-level", default=os.environ.get("MODELFLEET_LOG_LEVEL", "info"))
    parser.add_argument("--log-format", choices=("text", "json"), default=None,
                        help="'json': one JSON object per line, and a line per request/task "
                             "(env MODELFLEET_LOG_FORMAT; default text)")
    if gateway:
        parser.add_argument("--host", default=None, help="bind address (default 127.0.0.1)")
        parser.add_argument("--port", type=int, default=None, help="HTTP port (default 8000)")
    if worker:
        parser.add_argument("--permits", type=int, default=None,
                            help="most in-flight tasks on this worker (default 16)")
        parser.add_argument("--runtimes", type=int, default=None,
                            help="shared runtime processes (default 1)")
        parser.add_argument("--worker-id", default=None)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="modelfleet", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"modelfleet {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    _common(commands.add_parser("serve", help="gateway + embedded broker + worker, one process"),
            gateway=True, worker=True)
    _common(commands.add_parser("gateway", help="an HTTP gateway (distributed deployment)"),
            gateway=True, worker=False)
    worker = commands.add_parser("worker", help="a worker: coordinator and runtimes")
    _common(worker, gateway=False, worker=True)
    worker.add_argument("--probe-host", default="127.0.0.1")
    worker.add_argument("--probe-port", type=int, default=8001,
                        help="port of /livez, /readyz, /metrics (default 8001)")
    commands.add_parser("push", help="publish a model package through a gateway",
                        add_help=False)
    commands.add_parser("sim", help="fleet simulator: pull-affinity against push routers",
                        add_help=False)
    commands.add_parser("dlq", help="dead-letter queue: archive, list, replay", add_help=False)
    commands.add_parser("keys", help="API keys: create, list, revoke", add_help=False)
    commands.add_parser("tenants", help="tenants: plans and model grants", add_help=False)
    commands.add_parser("usage", help="usage per tenant, model and hour (--csv)",
                        add_help=False)
    return parser


def build_settings(args: argparse.Namespace) -> Settings:
    """Defaults < MODELFLEET_* environment < flags."""
    base = Settings()
    overrides: dict[str, Any] = {"repo": args.repo, "log_level": args.log_level}
    if args.log_format is not None:
        overrides["log_format"] = args.log_format
    if args.broker is not None:
        overrides["broker"] = base.broker.model_copy(update={"url": args.broker})
    gateway: dict[str, Any] = {}
    if getattr(args, "host", None) is not None:
        gateway["host"] = args.host
    if getattr(args, "port", None) is not None:
        gateway["port"] = args.port
    if gateway:
        overrides["gateway"] = base.gateway.model_copy(update=gateway)
    worker: dict[str, Any] = {}
    for flag, field in (("permits", "permits"), ("runtimes", "shared_runtimes"),
                        ("worker_id", "worker_id")):
        if getattr(args, flag, None) is not None:
            worker[field] = getattr(args, flag)
    if worker:
        overrides["worker"] = base.worker.model_copy(update=worker)
    # Re-validate the whole object so flag values get the same checks as defaults.
    return Settings.model_validate({**base.model_dump(), **{
        k: v.model_dump() if hasattr(v, "model_dump") else v for k, v in overrides.items()}})


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "sim":
        from modelfleet.sim.cli import main as sim_main

        return int(sim_main(argv[1:]))
    if argv and argv[0] == "push":
        from modelfleet.publishing.push import main as push_main

        return push_main(argv[1:])
    if argv and argv[0] == "dlq":
        from modelfleet.dlq.cli import main as dlq_main

        return int(dlq_main(argv[1:]))
    if argv and argv[0] in ("keys", "tenants", "usage"):
        from modelfleet.tenancy.cli import main as tenancy_main

        return tenancy_main(argv[0], argv[1:])
    args = build_parser().parse_args(argv)
    unknown = unknown_settings()
    if unknown:  # a misspelt setting would otherwise be ignored in silence
        print(f"modelfleet: error: no such setting: {', '.join(unknown)} (every setting is "
              f"in src/modelfleet/settings.py; README, Configuration)", file=sys.stderr)
        return EXIT_CONFIG
    try:
        settings = build_settings(args)
    except ValidationError as exc:
        first = exc.errors()[0]
        print(f"modelfleet: error: setting {'.'.join(map(str, first['loc']))}: {first['msg']}",
              file=sys.stderr)
        return EXIT_CONFIG
    configure_logging(settings.log_level, settings.log_format)
    from modelfleet import launch

    try:
        if args.command == "serve":
            asyncio.run(launch.serve(settings))
        elif args.command == "gateway":
            asyncio.run(launch.gateway(settings))
        else:
            asyncio.run(launch.worker(settings, args.probe_host, args.probe_port))
    except ModelfleetError as exc:
        return report("modelfleet", exc)
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    return 0
