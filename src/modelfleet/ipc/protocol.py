"""What the coordinator and a runtime process agree on: the ops and the environment.

Both sides import this module and nothing of each other: the worker never imports
the runtime's server (which would load the model host, the cache and the codecs into
the coordinator), and the runtime never imports the worker.
"""

from __future__ import annotations

from typing import Literal

Op = Literal["load", "evict", "infer", "health", "stats", "shutdown"]

# The runtime's settings, as JSON (``Settings.model_dump_json()``).
SETTINGS_ENV = "MODELFLEET_RUNTIME_SETTINGS"
# Top-level modules to import before serving (a standby runtime imports what the runtime
# it may replace had imported for its models, so that their reloads are quick).
PRELOAD_ENV = "MODELFLEET_RUNTIME_PRELOAD"
# The memory limit the runtime runs under, when the worker set one.
MEMORY_LIMIT_ENV = "MODELFLEET_MEMORY_LIMIT_BYTES"
