"""Settings of publishing models through the API (``Settings.publish``), frozen."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

MiB = 1024 * 1024


class PublishSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    # The publishing secret: set, every package must carry its HMAC-SHA256 signature
    # (``modelfleet push`` signs with MODELFLEET_PUBLISH__SECRET); unset, none is checked
    # and a package that carries one is refused (nothing here could check it).
    secret: str | None = Field(default=None, min_length=16)
    # A package's files, all together (unpacked: an archive bomb is stopped here too).
    max_package_bytes: int = Field(default=100 * MiB, gt=0)
    max_package_files: int = Field(default=1000, gt=0)
    # Importing the entrypoint in a throwaway interpreter: past this it is refused.
    import_timeout_s: float = Field(default=60, gt=0)
