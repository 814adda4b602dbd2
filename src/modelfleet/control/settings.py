"""Settings of the model control API (``Settings.control``), frozen like every section."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class ControlSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    # How long POST .../load waits for the model to be warm on the workers it asked
    # (and .../unload for every live worker to confirm) before answering an error.
    command_timeout_s: float = Field(default=120, gt=0)
    # After the unversioned route of a model moved to a new version, the old version
    # stays resident this long (tasks stamped with it before the switch still arrive),
    # then it is released.
    drain_s: float = Field(default=10, ge=0)
    # How often each worker re-announces its control state and its resident versions
    # (``{"kind": "worker_control"}``): how soon a gateway started later learns of an
    # unload, and how soon every gateway sees a new version warm.
    announce_interval_s: float = Field(default=1.0, gt=0)
    # A worker silent this long no longer counts as holding anything.
    stale_after_s: float = Field(default=10, gt=0)
