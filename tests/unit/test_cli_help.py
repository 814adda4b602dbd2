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


def _parsers() -> dict[str, argparse.ArgumentParser]:
    """Each command's own parser (the commands whose arguments ``modelfleet`` hands on)."""
    from modelfleet.dlq.cli import build_parser as dlq
    from modelfleet.publishing.push import build_parser as push
    from modelfleet.sim.cli import build_parser as sim
    from modelfleet.tenancy.cli import keys_parser, tenants_parser, usage_parser

    top = build_parser()
    subcommands = next(action for action in top._actions
                       if isinstance(action, argparse._SubParsersAction))
    own = {"push": push(), "sim": sim(), "dlq": dlq(), "keys": keys_parser(),
           "tenants": tenants_parser(), "usage": usage_parser()}
    return {name: own.get(name, parser) for name, parser in subcommands.choices.items()}


def _paths(parser: argparse.ArgumentParser, prefix: tuple[str, ...]
           ) -> list[tuple[str, ...]]:
    """``prefix`` and every subcommand path under it, however deep."""
    paths = [prefix]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                paths += _paths(sub, (*prefix, name))
    return paths


EVERY_PATH = [path for name, parser in _parsers().items() for path in _paths(parser, (name,))]


def test_the_walk_reaches_the_nested_subcommands() -> None:
    assert {("dlq", "replay"), ("keys", "create"), ("tenants", "grant")} <= set(EVERY_PATH)
    assert {path[0] for path in EVERY_PATH} == set(COMMANDS)


@pytest.mark.parametrize("path", EVERY_PATH, ids=" ".join)
def test_help_of_every_command_and_subcommand(path: tuple[str, ...],
                                              capsys: pytest.CaptureFixture[str]) -> None:
    """``modelfleet <command> [<subcommand>...] --help``, as the command line dispatches
    it (in this process: a help string argparse cannot format raises here too)."""
    from modelfleet.cli import main

    try:
        code = main([*path, "--help"])
    except SystemExit as exc:
        code = exc.code
    out = capsys.readouterr()
    assert code in (0, None), out.err
    assert out.out.lower().startswith("usage:")
    assert out.out.splitlines()[0].startswith(f"usage: modelfleet {' '.join(path)}"), out.out
