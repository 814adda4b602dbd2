"""What a handler may declare to the runtime's memory tiers, as protocols.

The runtime asks these questions of every handler with ``isinstance``, never by
probing attribute names, so a reader can find every handler that answers them:

- ``SizedModel``: ``memory_bytes()`` says how much device memory the loaded model
  holds (otherwise the runtime measures the buffers reachable from the handler);
- ``TierMovable``: ``to_host()`` / ``to_device()`` move the weights between device
  and host memory, so a demotion keeps the model and a promotion is a copy, not a
  reload (``TorchModel`` implements them for torch modules).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable


@runtime_checkable
class SizedModel(Protocol):
    def memory_bytes(self) -> int: ...


@runtime_checkable
class TierMovable(Protocol):
    def to_host(self) -> None: ...

    def to_device(self) -> None: ...
