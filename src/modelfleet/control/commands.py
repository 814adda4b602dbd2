"""Control commands and their results, as they travel on the broker's event channel.

A gateway publishes a ``Command`` (``{"kind": "control"}``) for each call of the
control API; every worker (and every other gateway) applies its order to its own
``ControlState`` and the workers named in it act on it, each answering with a
``Result`` (``{"kind": "control_result"}``) that the asking gateway collects. Nothing
is ever sent to a worker's address.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, get_args

from modelfleet.control.state import ControlState, Revision

Action = Literal["load", "unload", "pin", "unpin", "route"]
ACTIONS: tuple[Action, ...] = get_args(Action)


@dataclass(frozen=True)
class Command:
    command_id: str
    model_id: str
    action: Action
    revision: Revision
    version: str = ""  # load: the version to warm; route: the version the route takes
    workers: tuple[str, ...] = ()  # the workers that must act and answer
    named: bool = False  # load: the operator named the version (else the route's was taken)
    config: str = ""  # load: the override of model.toml's settings it gives ("": none)

    def apply(self, state: ControlState) -> bool:
        """Record this command's order; True if it changed the state."""
        if self.action == "load":
            changed = state.set(self.model_id, "loaded", True, self.revision)
            # Every load says how the model is configured: a load without a config
            # takes it back to its model.toml.
            changed |= state.set(self.model_id, "config", self.config, self.revision)
            if not self.named:  # a load of no named version: the route follows the newest
                changed |= state.set(self.model_id, "version", "", self.revision)
            return changed
        if self.action == "unload":
            return state.set(self.model_id, "loaded", False, self.revision)
        if self.action in ("pin", "unpin"):
            return state.set(self.model_id, "pinned", self.action == "pin", self.revision)
        return state.set(self.model_id, "version", self.version, self.revision)

    def event(self) -> dict[str, Any]:
        return {"kind": "control", "command_id": self.command_id, "model_id": self.model_id,
                "action": self.action, "at": self.revision.at, "origin": self.revision.origin,
                "version": self.version, "workers": list(self.workers), "named": self.named,
                "config": self.config}

    @classmethod
    def from_event(cls, event: dict[str, Any]) -> Command | None:
        """The command an event carries; None if it is not a well-formed one."""
        try:
            action, at, workers = event["action"], event["at"], event.get("workers", [])
            if action not in ACTIONS or isinstance(at, bool) or not isinstance(at, int | float) \
                    or not isinstance(workers, list) \
                    or not all(isinstance(w, str) for w in workers):
                return None
            fields = (event["command_id"], event["model_id"], event["origin"],
                      event.get("version", ""), event.get("config", ""))
            if not all(isinstance(f, str) for f in fields):
                return None
            return cls(fields[0], fields[1], action, Revision(float(at), fields[2]),
                       fields[3], tuple(workers), event.get("named") is True, fields[4])
        except KeyError:
            return None


@dataclass(frozen=True)
class Result:
    """One worker's answer to a command: done, or why not."""

    command_id: str
    worker_id: str
    model_id: str
    version: str
    ok: bool
    code: str = ""
    message: str = ""

    def event(self) -> dict[str, Any]:
        return {"kind": "control_result", "command_id": self.command_id,
                "worker_id": self.worker_id, "model_id": self.model_id,
                "version": self.version, "ok": self.ok, "code": self.code,
                "message": self.message}

    @classmethod
    def from_event(cls, event: dict[str, Any]) -> Result | None:
        names = ("command_id", "worker_id", "model_id", "version", "code", "message")
        values = [event.get(name, "") for name in names]
        if not all(isinstance(v, str) for v in values) or not isinstance(event.get("ok"), bool):
            return None
        return cls(values[0], values[1], values[2], values[3], event["ok"], values[4],
                   values[5])
