"""Every ``modelfleet`` subcommand answers ``--help`` with its usage, not a traceback."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from modelfleet.cli import build_parser

COMMANDS = ["serve", "gateway", "worker", "push", "sim", "dlq", "keys", "tenants", "usage"]


def test_the_list_is_every_subcommand() -> None:
    parser = build_parser()
    subcommands = next(action for action in parser._actions
                       if isinstance(action, argparse._SubParsersAction))
    assert sorted(subcommands.choices) == sorted(COMMANDS)


@pytest.mark.parametrize("command", [None, *COMMANDS])
def test_help_prints_usage_and_exits_0(command: str | None) -> None:
    argv = [sys.executable, "-m", "modelfleet", *([command] if command else []), "--help"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr
    assert done.stdout.lower().startswith("usage:")
    if command is not None:
        assert command in done.stdout.splitlines()[0]
