"""What the tenancy end-to-end modules share: the keys/tenants/usage commands, a key's
headers, one banner call, the processes' tenancy settings and broker names of a test's
own, and the check that no key reached a log.

The commands run through their own entry (``modelfleet.cli.main``) in the test process:
each call started a Python and imported modelfleet (~0.7 s of CPU; a module makes dozens,
the usage polls among them). ``tests/unit/test_cli_help.py`` starts the commands."""

from __future__ import annotations

import contextlib
import io
import os
import uuid
from pathlib import Path

import httpx

from modelfleet.cli import main
from tests.procs import Proc

POSTGRES_URL = os.environ.get("MODELFLEET_TEST_POSTGRES",
                              "postgresql://postgres@127.0.0.1:5432/test")


def cli(db: Path | str, *args: str) -> str:
    """Run ``modelfleet <args> --db db`` (its entry, in this process); its stdout (it
    must succeed)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([*args, "--db", str(db)])
    assert code == 0, err.getvalue()
    return out.getvalue().strip()


def new_key(db: Path | str, tenant: str, role: str = "caller", plan: str | None = None,
            plans_file: Path | None = None) -> str:
    extra = ["--plan", plan] if plan else []
    extra += ["--plans-file", str(plans_file)] if plans_file else []
    return cli(db, "keys", "create", "--tenant", tenant, "--role", role, *extra)


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def banner(base: str, key: str | None, **kwargs: object) -> httpx.Response:
    headers = {"content-type": "text/plain", **(bearer(key) if key else {})}
    return httpx.post(f"{base}/v1/models/banner/infer", content=b"hi", headers=headers,
                      timeout=60, **kwargs)  # type: ignore[arg-type]


def tenancy_env(db: Path | str) -> dict[str, str]:
    return {"MODELFLEET_TENANCY__DB": str(db), "MODELFLEET_TENANCY__CACHE_TTL_S": "1",
            "MODELFLEET_TENANCY__USAGE_FLUSH_S": "0.5",
            "MODELFLEET_TENANCY__REDIS_PREFIX": f"test-{uuid.uuid4().hex[:8]}:",
            "MODELFLEET_LOG_LEVEL": "debug"}


def broker_names() -> dict[str, str]:
    tag = f"tn{uuid.uuid4().hex[:8]}"
    return {"MODELFLEET_BROKER__QUEUE_PREFIX": f"{tag}.",
            "MODELFLEET_BROKER__EVENTS_EXCHANGE": f"{tag}.events",
            "MODELFLEET_BROKER__DEAD_LETTER_QUEUE": f"{tag}.dead-letters"}


def assert_no_key_logged(procs: list[Proc], keys: list[str]) -> None:
    for proc in procs:
        log = proc.log()
        assert " DEBUG " in log, "the processes must log at DEBUG for this check"
        for key in keys:
            secret = key.split("_", 2)[2]
            assert secret not in log, f"{proc.args[0]} logged a key:\n" \
                f"{log[max(0, log.find(secret) - 300):log.find(secret) + 300]}"
