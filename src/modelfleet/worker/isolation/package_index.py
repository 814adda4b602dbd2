"""Where packages come from: pip's index configuration, handed to uv.

uv does not read pip's configuration, and a machine set up for pip (a mirror, extra
indexes, find-links, constraints, a CA bundle) should build model environments from the
same places. ``IndexConfig.from_pip()`` reads pip's files in pip's order and its
``PIP_*`` variables and turns them into uv flags.
"""

from __future__ import annotations

import configparser
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class IndexConfig:
    """Where uv finds packages; ``from_pip()`` copies pip's configuration."""

    index_url: str | None = None  # None: uv's default (PyPI)
    extra_index_urls: tuple[str, ...] = ()
    find_links: tuple[str, ...] = ()
    constraints: tuple[str, ...] = ()
    no_index: bool = False
    cert: str | None = None

    @classmethod
    def from_pip(cls, environ: Mapping[str, str] | None = None,
                 files: Sequence[Path] | None = None) -> IndexConfig:
        """pip's index settings: config files in pip's order, then ``PIP_*`` variables."""
        env = os.environ if environ is None else environ
        parser = configparser.RawConfigParser()
        parser.read([str(f) for f in (_pip_config_files(env) if files is None else files)])
        values: dict[str, str] = {}
        for section in ("global", "install"):  # [install] overrides [global] for installs
            if parser.has_section(section):
                values.update((k.replace("_", "-"), v) for k, v in parser.items(section))
        for key in ("index-url", "extra-index-url", "find-links", "constraint", "no-index",
                    "cert"):
            variable = "PIP_" + key.upper().replace("-", "_")
            if variable in env:
                values[key] = env[variable]
        return cls(
            index_url=values.get("index-url") or None,
            extra_index_urls=tuple(values.get("extra-index-url", "").split()),
            find_links=tuple(values.get("find-links", "").split()),
            constraints=tuple(values.get("constraint", "").split()),
            no_index=values.get("no-index", "").lower() in ("1", "true", "yes", "on"),
            cert=values.get("cert") or None,
        )

    def uv_args(self) -> list[str]:
        args: list[str] = []
        if self.index_url:
            args += ["--index-url", self.index_url]
        for url in self.extra_index_urls:
            args += ["--extra-index-url", url]
        if self.extra_index_urls:
            # pip takes the best version across all indexes; uv by default stops at the
            # first index that has the project, so a mirror holding only six 1.17 would
            # hide six 1.16 on PyPI. Match pip.
            args += ["--index-strategy", "unsafe-best-match"]
        for location in self.find_links:
            args += ["--find-links", location]
        for path in self.constraints:
            args += ["--constraints", path]
        if self.no_index:
            args.append("--no-index")
        return args

    def uv_env(self) -> dict[str, str]:
        return {"SSL_CERT_FILE": self.cert} if self.cert else {}


def _pip_config_files(env: Mapping[str, str]) -> list[Path]:
    """pip's configuration files, lowest priority first (pip's "global, user, site")."""
    if env.get("PIP_CONFIG_FILE") == os.devnull:
        return []
    xdg_dirs = env.get("XDG_CONFIG_DIRS", "/etc/xdg").split(os.pathsep)
    files = [Path(d) / "pip" / "pip.conf" for d in xdg_dirs if d]
    files.append(Path("/etc/pip.conf"))
    home = Path(env.get("HOME", str(Path.home())))
    files.append(home / ".pip" / "pip.conf")
    files.append(Path(env.get("XDG_CONFIG_HOME", str(home / ".config"))) / "pip" / "pip.conf")
    files.append(Path(sys.prefix) / "pip.conf")
    if env.get("PIP_CONFIG_FILE"):
        files.append(Path(env["PIP_CONFIG_FILE"]))
    return files
