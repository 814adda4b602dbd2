"""What a package must be before it reaches the repository.

``resolve`` (pure): the manifest parses with the repository's own parser, names the
model it is published as, its entrypoint module and label files are in the package, and
its version is settled: the manifest's ``version`` if it states one, else the one the
caller asked for, else the next whole number after the model's versions (``version =
"N"`` is then written into the manifest, which must match its folder). A version that
exists is refused (``VersionExists``): versions never change.

``check_entrypoint``: the package is written to a temporary folder and a new interpreter
(``python -m modelfleet.publishing.entrypoint``) imports the entrypoint as a runtime
would, in that folder, with a bare environment (no ``MODELFLEET_*`` or cloud secrets),
in a session of its own that is killed at ``publish.import_timeout_s``. The gateway's
own process never runs package code. A model with its own ``[isolation] requirements``
gets them installed only on workers, so its modules are compiled and its class looked
up in the source instead of imported.
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import os
import signal
import sys
import tempfile
import tomllib
from dataclasses import dataclass
from pathlib import Path

import modelfleet
from modelfleet.errors import ManifestError, PackageRejected, VersionExists
from modelfleet.publishing.package import MANIFEST, Package
from modelfleet.repository.manifest import VERSION, Manifest, parse_manifest

_STDERR_KEPT_BYTES = 4096
_ENV_KEPT = ("PATH", "LANG", "LC_ALL", "SYSTEMROOT", "TMPDIR")
# The child runs in the package's folder: where this modelfleet is, by absolute path.
_OUR_ROOT = str(Path(modelfleet.__file__).resolve().parent.parent)


@dataclass(frozen=True)
class Candidate:
    """A package ready to be written: its manifest and the files as they will be kept."""

    manifest: Manifest
    package: Package

    @property
    def version(self) -> str:
        return self.manifest.version


def next_version(existing: list[str]) -> str:
    """One more than the highest whole-number version (1 for none)."""
    numbers = [int(v) for v in existing if v.isdigit()]
    return str(max(numbers, default=0) + 1)


def resolve(package: Package, model_id: str, requested: str | None,
            existing: list[str]) -> Candidate:
    where = f"{model_id}'s {MANIFEST}"
    raw = package.files.get(MANIFEST)
    if raw is None:
        raise PackageRejected(f"the package has no {MANIFEST} at its top")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise PackageRejected(f"{where} is not UTF-8 text: {exc}") from exc
    manifest = _parsed(text, where)
    stated = _states_version(text)
    if manifest.name != model_id:
        raise PackageRejected(f"{where} names model '{manifest.name}': publish it as "
                              f"'{manifest.name}', or change its name to '{model_id}'")
    if stated and requested is not None and requested != manifest.version:
        raise PackageRejected(f"the request asks for version '{requested}' but {where} "
                              f"says version = \"{manifest.version}\"")
    if requested is not None and not VERSION.match(requested):
        raise PackageRejected(f"version {requested!r} is not one: letters, digits, '.', '_' "
                              "or '-', at most 64, starting with a letter or digit")
    if not stated:
        version = requested if requested is not None else next_version(existing)
        text = f'version = "{version}"  # set when it was published\n{text}'
        manifest = _parsed(text, where)
        package = package.with_manifest(text)
    if manifest.version in existing:
        raise VersionExists(f"model '{model_id}' has a version '{manifest.version}' "
                            "already: a version never changes once published (publish "
                            "another version, or leave the version out to get the next one)")
    module, _, _ = manifest.entrypoint.partition(":")
    source = module.replace(".", "/") + ".py"
    if source not in package.files:
        raise PackageRejected(f"{where} names entrypoint '{manifest.entrypoint}' but the "
                              f"package has no {source}")
    for spec in manifest.outputs:
        if spec.labels is not None and spec.labels not in package.files:
            raise PackageRejected(f"{where}: output '{spec.name}' names labels file "
                                  f"{spec.labels}, which the package lacks")
    return Candidate(manifest, package)


def _parsed(text: str, where: str) -> Manifest:
    try:
        return parse_manifest(text, where)
    except ManifestError as exc:
        raise PackageRejected(str(exc)) from exc


def _states_version(text: str) -> bool:
    return "version" in tomllib.loads(text)  # parsed once already: valid TOML


async def check_entrypoint(candidate: Candidate, timeout_s: float) -> None:
    """PackageRejected unless the entrypoint imports (see the module docstring)."""
    with tempfile.TemporaryDirectory(prefix="modelfleet-publish-") as tmp:
        folder = Path(tmp) / "package"
        await asyncio.to_thread(_write, folder, candidate.package)
        if candidate.manifest.isolation.requirements:
            _check_source(candidate)
            return
        await _import_in_child(folder, Path(tmp), candidate.manifest, timeout_s)


def _write(folder: Path, package: Package) -> None:
    for path, data in package.files.items():
        target = folder / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)


async def _import_in_child(folder: Path, home: Path, manifest: Manifest,
                           timeout_s: float) -> None:
    child = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "modelfleet.publishing.entrypoint", str(folder), cwd=folder,
        env=_child_env(home), stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE, start_new_session=True)
    try:
        tail = await asyncio.wait_for(_tail(child), timeout_s)
        code = await asyncio.wait_for(child.wait(), timeout_s)
    except TimeoutError:
        raise PackageRejected(f"importing entrypoint '{manifest.entrypoint}' took longer "
                              f"than {timeout_s:g}s (publish.import_timeout_s): a module "
                              "should not do its work at import; load() is where it "
                              "goes") from None
    finally:
        if child.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.pid, signal.SIGKILL)
            await child.wait()
    if code != 0:
        said = tail.decode("utf-8", "replace").strip().replace(str(folder), "<package>")
        lines = said.splitlines()
        raise PackageRejected(f"entrypoint '{manifest.entrypoint}' does not import: "
                              f"{lines[-1] if lines else f'the interpreter exited {code}'}")


def _child_env(home: Path) -> dict[str, str]:
    """A bare environment: no MODELFLEET_* settings, no cloud credentials."""
    env = {name: os.environ[name] for name in _ENV_KEPT if name in os.environ}
    paths = [_OUR_ROOT, *(os.path.abspath(p) for p in
                          os.environ.get("PYTHONPATH", "").split(os.pathsep) if p)]
    env.update({"HOME": str(home), "PYTHONDONTWRITEBYTECODE": "1",
                "PYTHONPATH": os.pathsep.join(paths)})
    return env


async def _tail(child: asyncio.subprocess.Process) -> bytes:
    """The end of what the child wrote to stderr, read to its end (kept bounded)."""
    assert child.stderr is not None
    kept = b""
    while chunk := await child.stderr.read(65536):
        kept = (kept + chunk)[-_STDERR_KEPT_BYTES:]
    return kept


def _check_source(candidate: Candidate) -> None:
    manifest = candidate.manifest
    module, _, class_name = manifest.entrypoint.partition(":")
    source = module.replace(".", "/") + ".py"
    for path, data in candidate.package.files.items():
        if not path.endswith(".py"):
            continue
        try:
            tree = ast.parse(data, filename=path)
        except (SyntaxError, ValueError) as exc:
            raise PackageRejected(f"{path} does not compile: {exc}") from exc
        if path == source and not any(isinstance(node, ast.ClassDef) and
                                      node.name == class_name for node in tree.body):
            raise PackageRejected(f"entrypoint '{manifest.entrypoint}': {source} defines "
                                  f"no class {class_name}")
