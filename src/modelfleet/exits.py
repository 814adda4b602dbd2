"""How a command reports a modelfleet error: one line on stderr, and an exit code.

    0 ok · 1 failed · 2 configuration or usage · 3 broker unreachable · 130 interrupted

Commands with failures of their own (``modelfleet dlq``'s archive) add codes above 3.
"""

from __future__ import annotations

import sys

from modelfleet.errors import BrokerUnavailable, ConfigError, ModelfleetError

EXIT_FAILED = 1
EXIT_CONFIG = 2
EXIT_BROKER = 3
EXIT_INTERRUPTED = 130


def report(prog: str, error: ModelfleetError) -> int:
    """Print ``error`` for the user of ``prog`` and return the exit code it stands for."""
    if isinstance(error, BrokerUnavailable):
        print(f"{prog}: error: cannot reach the broker: {error}", file=sys.stderr)
        return EXIT_BROKER
    print(f"{prog}: error: {error}", file=sys.stderr)
    return EXIT_CONFIG if isinstance(error, ConfigError) else EXIT_FAILED
