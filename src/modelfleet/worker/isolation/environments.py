"""Per-model virtual environments: built with uv, once per requirements hash, then reused.

A model that declares requirements runs in its own runtime process, on the
interpreter of a virtual environment that holds exactly:

- the model's requirements (``[isolation] requirements`` and a shipped
  ``requirements.txt``),
- the few distributions that modelfleet's runtime imports (msgpack, pydantic, ...),
  resolved *together with* the model's requirements in one uv resolution, so the
  model's pins win or the build fails naming the conflict,
- modelfleet's own code, as a symlink to the ``modelfleet`` package directory.

Nothing falls through to the coordinator's environment: no ``.pth`` to its
site-packages, which would let any package the model did not pin (a transitive
dependency, say) come from the coordinator's versions, built against other pins.
The price is one copy per environment of a handful of small packages, which uv
hardlinks from its shared cache.

Layout of ``venv_root``::

    <hash>/                          the environment (bin/python, lib/...)
    <hash>/.modelfleet-env.json      completion marker, written last
    <hash>.lock                      flock: one builder per hash across processes

``<hash>`` is the sha256 of the normalised, sorted requirement lines, the runtime's
own requirements and the interpreter's version. An environment without its
marker is a build that died; the next builder removes it and starts again.

uv is pointed at the same package index as pip: ``IndexConfig.from_pip()`` reads
pip's configuration files and ``PIP_*`` variables and turns them into uv flags.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import fcntl
import hashlib
import importlib.metadata
import json
import logging
import os
import re
import shutil
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name

import modelfleet
from modelfleet.errors import ConfigError, ManifestError, ModelLoadFailed
from modelfleet.repository.manifest import Manifest
from modelfleet.worker.isolation.package_index import IndexConfig

log = logging.getLogger("modelfleet.worker.isolation.environments")

Progress = Callable[[str], None]

MARKER = ".modelfleet-env.json"
LAYOUT = "modelfleet-env-v1"  # bump when what an environment holds changes

# The distributions ``python -m modelfleet.runtime`` imports (directly or lazily, like
# fsspec for remote repositories). Versions come from modelfleet's own metadata. Each
# build checks that ``modelfleet.runtime.server`` imports, so a new runtime import that
# is missing here fails the build loudly instead of the first request.
RUNTIME_DISTRIBUTIONS = ("msgpack", "pydantic", "pydantic-settings", "httpx", "zstandard",
                         "psutil", "fsspec")

# Variables that would let the coordinator's packages leak into an isolated interpreter.
LEAKY_ENV = ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "VIRTUAL_ENV", "__PYVENV_LAUNCHER__")


class EnvironmentBuildFailed(ModelLoadFailed):
    """A model's environment could not be built; ``package`` names the culprit if known.

    The message says which requirement failed and why, then ends with uv's own
    output (``uv_output``) for the details.
    """

    def __init__(self, message: str, package: str | None = None, uv_output: str = "") -> None:
        tail = f"\n--- uv said ---\n{uv_output.strip()}" if uv_output.strip() else ""
        super().__init__(message + tail)
        self.package = package
        self.uv_output = uv_output


# --- requirements ----------------------------------------------------------------

def canonical_name(name: str) -> str:
    """PEP 503: ``Foo.Bar_baz`` and ``foo-bar-baz`` are the same project."""
    return str(canonicalize_name(name))


def _parse(line: str) -> Requirement:
    text = line.split(" #", 1)[0].strip()
    if text.startswith("-"):
        raise ValueError(f"{line.strip()!r}: pip options are not supported here "
                         "(the worker's index configuration applies to every model)")
    try:
        return Requirement(text)
    except InvalidRequirement as exc:
        raise ValueError(f"{line.strip()!r} is not a requirement (expected e.g. "
                         f"'six==1.16.0'): {exc}") from exc


def normalise_requirement(line: str) -> str:
    """One PEP 508 requirement in a canonical spelling; ``ValueError`` if it is not one.

    ``NumPy >= 1.0 , <2 ; python_version<'3.12'`` becomes
    ``numpy<2,>=1.0; python_version < "3.12"``: the hash then does not change with
    spelling, spacing or specifier order. Parsing is ``packaging``'s (PEP 508).
    """
    requirement = _parse(line)
    out = canonical_name(requirement.name)
    if requirement.extras:
        out += f"[{','.join(sorted(canonical_name(e) for e in requirement.extras))}]"
    if requirement.url:
        out += f" @ {requirement.url}"
    elif requirement.specifier:
        out += ",".join(sorted(str(spec) for spec in requirement.specifier))
    return f"{out}; {requirement.marker}" if requirement.marker else out


def normalise_requirements(lines: Iterable[str]) -> tuple[str, ...]:
    """Canonical, sorted, de-duplicated requirements; blank lines and comments dropped."""
    kept = (line for line in lines if line.strip() and not line.lstrip().startswith("#"))
    return tuple(sorted({normalise_requirement(line) for line in kept}))


def requirement_name(requirement: str) -> str:
    try:
        return canonical_name(_parse(requirement).name)
    except ValueError:
        return requirement


def requirements_for(package_dir: Path, manifest: Manifest) -> tuple[str, ...]:
    """The model's requirements: ``[isolation] requirements`` plus a shipped requirements.txt.

    Raises ``ManifestError`` naming the file and line of a requirement that does not parse.
    """
    merged: list[str] = []
    for index, line in enumerate(manifest.isolation.requirements):
        try:
            merged.append(normalise_requirement(line))
        except ValueError as exc:
            raise ManifestError(str(package_dir / "model.toml"),
                                f"isolation.requirements.{index}", str(exc)) from exc
    path = package_dir / "requirements.txt"
    if path.is_file():
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            try:
                merged.append(normalise_requirement(line))
            except ValueError as exc:
                raise ManifestError(str(path), f"line {number}", str(exc)) from exc
    return normalise_requirements(merged)


def runtime_requirements() -> tuple[str, ...]:
    """What modelfleet's runtime needs, with the version ranges modelfleet declares."""
    try:
        declared = importlib.metadata.requires("modelfleet") or []
    except importlib.metadata.PackageNotFoundError:  # a bare source tree: names only
        declared = []
    wanted = {canonical_name(n) for n in RUNTIME_DISTRIBUTIONS}
    found: dict[str, str] = {}
    for line in declared:
        if ";" in line and "extra" in line.partition(";")[2]:
            continue  # an optional extra, not a runtime dependency
        name = requirement_name(line)
        if name in wanted:
            found[name] = normalise_requirement(line)
    return tuple(sorted(found.get(n, n) for n in wanted))


def environment_hash(requirements: Iterable[str], python_version: str,
                     runtime: Iterable[str] = ()) -> str:
    """sha256 naming the environment for these requirements on this interpreter."""
    lines = [LAYOUT, f"python {python_version}"]
    lines += [f"runtime {r}" for r in normalise_requirements(runtime)]
    lines += [f"model {r}" for r in normalise_requirements(requirements)]
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()


# --- reading uv's errors -----------------------------------------------------------

_PKG = r"([A-Za-z0-9][A-Za-z0-9._-]*?)(?=[\s\[<>=!~,;`]|$)"
_CAUSES: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(rf"\b{_PKG}\s+was not found in the"), "no such package on the index"),
    (re.compile(rf"there (?:is|are) no versions? of {_PKG}"), "no version matches"),
    (re.compile(rf"only (?:the following versions of )?{_PKG}"), "no version matches"),
    (re.compile(rf"Failed to (?:build|download|fetch|prepare|install)[^`\n]*`{_PKG}"),
     "it failed to build or download"),
    (re.compile(rf"Because (?:you require |all versions of )?{_PKG}"), "conflicting requirements"),
)


def diagnose(output: str, requested: Iterable[str]) -> tuple[str | None, str]:
    """The package uv's error is about, and why, e.g. ``("foo", "no version matches")``.

    Prefers a package the model asked for over one that came in as a dependency.
    """
    asked = {requirement_name(r) for r in requested}
    found: list[tuple[str, str]] = []
    for pattern, reason in _CAUSES:
        found += [(m.group(1), reason) for m in pattern.finditer(output)]
    for name, reason in found:
        if canonical_name(name) in asked:
            return name, reason
    if found:
        return found[0]
    if "Failed to fetch" in output or "Request failed" in output:
        return None, "the package index could not be reached"
    return None, "uv failed"


# --- building ------------------------------------------------------------------------


@dataclass(frozen=True)
class _Spec:
    requirements: tuple[str, ...]
    runtime: tuple[str, ...]
    python_version: str
    digest: str = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "digest", environment_hash(
            self.requirements, self.python_version, self.runtime))


def venv_process_env(environ: Mapping[str, str]) -> dict[str, str]:
    """``environ`` without the variables that would leak the coordinator's packages in."""
    return {k: v for k, v in environ.items() if k not in LEAKY_ENV}


def find_uv() -> str:
    """uv next to this interpreter, from the ``uv`` package, or on PATH."""
    beside = Path(sys.executable).parent / "uv"
    if beside.is_file():
        return str(beside)
    with contextlib.suppress(ImportError, FileNotFoundError):
        import uv  # the PyPI package that ships the binary

        return str(uv.find_uv_bin())
    on_path = shutil.which("uv")
    if on_path is None:
        raise ConfigError("uv is not installed: install it (pip install uv) "
                          "or pass the path of its binary")
    return on_path


class EnvironmentBuilder:
    """Builds and reuses model environments under ``venv_root``; one build per hash."""

    def __init__(self, venv_root: Path, uv: str | None = None, python: str = sys.executable,
                 index_url: str | None = None, *, index: IndexConfig | None = None,
                 build_timeout_s: float = 900.0) -> None:
        self.venv_root = Path(venv_root).absolute()  # interpreters are spawned from anywhere
        self._uv = uv or find_uv()
        self._python = python
        index = IndexConfig.from_pip() if index is None else index
        self.index = replace(index, index_url=index_url) if index_url else index
        self._build_timeout_s = build_timeout_s
        self._runtime = runtime_requirements()
        self._locks: dict[str, asyncio.Lock] = {}
        self._python_version: str | None = None

    def path_for(self, digest: str) -> Path:
        return self.venv_root / digest

    async def ensure(self, requirements: Sequence[str], progress: Progress) -> Path:
        """The interpreter of an environment holding ``requirements``; builds it if needed.

        A second call for the same requirements returns at once, without running uv;
        concurrent calls (here or in another worker process) wait for one build.
        Raises ``EnvironmentBuildFailed`` naming the package that could not be installed.
        """
        try:
            normalised = normalise_requirements(requirements)
        except ValueError as exc:
            raise EnvironmentBuildFailed(f"invalid requirement: {exc}") from exc
        spec = _Spec(normalised, self._runtime, await self._version())
        env = self.path_for(spec.digest)
        if _complete(env):
            return _interpreter(env)
        async with self._locks.setdefault(spec.digest, asyncio.Lock()):
            if _complete(env):  # built while we waited for the in-process lock
                return _interpreter(env)
            self.venv_root.mkdir(parents=True, exist_ok=True)
            async with _exclusive(self.venv_root / f"{spec.digest}.lock"):
                if not _complete(env):  # another process may have built it meanwhile
                    await self._build(env, spec, progress)
        return _interpreter(env)

    async def _version(self) -> str:
        if self._python_version is None:
            if self._python == sys.executable:
                self._python_version = _version_of_this_interpreter()
            else:
                code = ("import platform, sys; "
                        "print(platform.python_implementation().lower(), *sys.version_info[:3])")
                rc, out = await self._run([self._python, "-c", code], None)
                if rc != 0:
                    raise EnvironmentBuildFailed(f"cannot run {self._python}: {out.strip()}")
                impl, *numbers = out.split()
                self._python_version = f"{impl}-{'.'.join(numbers)}"
        return self._python_version

    async def _build(self, env: Path, spec: _Spec, progress: Progress) -> None:
        tag = spec.digest[:12]
        progress(f"building environment {tag} for: {' '.join(spec.requirements) or '(nothing)'}")
        started = time.monotonic()

        def relay(line: str) -> None:
            if not line.startswith("Activate with:"):  # uv's hint for shells, noise here
                progress(f"environment {tag}: {line}")

        await asyncio.to_thread(shutil.rmtree, env, True)  # a build that died before its marker
        try:
            async with asyncio.timeout(self._build_timeout_s):
                await self._uv_call(["venv", "--python", self._python, str(env)], relay, spec)
                python = _interpreter(env)
                await self._uv_call(["pip", "install", "--python", str(python),
                                     *self.index.uv_args(), *spec.runtime, *spec.requirements],
                                    relay, spec)
                await self._link_modelfleet(python)
                await self._check_runtime_imports(python, spec)
        except TimeoutError:
            await asyncio.to_thread(shutil.rmtree, env, True)
            raise EnvironmentBuildFailed(
                f"environment {tag} did not build within {self._build_timeout_s:.0f}s "
                f"(requirements: {', '.join(spec.requirements)}); is the index reachable?"
            ) from None
        except BaseException:
            await asyncio.to_thread(shutil.rmtree, env, True)
            raise
        build_s = time.monotonic() - started
        _write_marker(env, {"requirements": list(spec.requirements),
                            "runtime": list(spec.runtime), "python": spec.python_version,
                            "built_at": time.time(), "build_s": round(build_s, 3)})
        log.info("built environment %s in %.1fs: %s", env, build_s, " ".join(spec.requirements))
        progress(f"environment {tag} ready in {build_s:.1f}s")

    async def _uv_call(self, args: list[str], relay: Progress, spec: _Spec) -> None:
        rc, out = await self._run([self._uv, *args, "--color", "never"], relay)
        if rc != 0:
            package, reason = diagnose(out, spec.requirements)
            what = f"cannot install {package!r}: {reason}" if package else reason
            raise EnvironmentBuildFailed(
                f"{what} (requirements: {', '.join(spec.requirements) or '(none)'}); "
                "check the name and version in [isolation] requirements or requirements.txt",
                package=package, uv_output=out)

    async def _link_modelfleet(self, python: Path) -> None:
        code = "import sysconfig; print(sysconfig.get_path('purelib'))"
        rc, out = await self._run([str(python), "-c", code], None)
        if rc != 0:
            raise EnvironmentBuildFailed(f"the new environment's python does not run: {out}")
        await asyncio.to_thread(_link_modelfleet, Path(out.strip()))

    async def _check_runtime_imports(self, python: Path, spec: _Spec) -> None:
        rc, out = await self._run([str(python), "-c", "import modelfleet.runtime.server"], None)
        if rc != 0:
            last = out.strip().splitlines()[-1] if out.strip() else f"exit code {rc}"
            raise EnvironmentBuildFailed(
                f"modelfleet's runtime does not import next to these requirements ({last}); "
                f"a pin may be too old for modelfleet, which needs {', '.join(spec.runtime)}",
                uv_output=out)

    async def _run(self, argv: list[str], relay: Progress | None) -> tuple[int, str]:
        """Run ``argv``; relay each output line; return the exit code and the last lines."""
        env = venv_process_env(os.environ) | self.index.uv_env()
        try:
            process = await asyncio.create_subprocess_exec(
                *argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT, env=env)
        except OSError as exc:
            raise EnvironmentBuildFailed(f"cannot run {argv[0]}: {exc.strerror}") from exc
        assert process.stdout is not None
        tail: collections.deque[str] = collections.deque(maxlen=200)
        try:
            async for raw in process.stdout:
                line = raw.decode(errors="replace").rstrip()
                tail.append(line)
                if relay is not None and line.strip():
                    relay(line.strip())
            return await process.wait(), "\n".join(tail)
        finally:
            if process.returncode is None:  # cancelled or timed out: stop uv
                with contextlib.suppress(ProcessLookupError):
                    process.kill()
                await process.wait()


def _link_modelfleet(purelib: Path) -> None:
    target = purelib / "modelfleet"
    if target.exists() or target.is_symlink():
        raise EnvironmentBuildFailed(
            "a requirement installed its own 'modelfleet' package; remove it from the "
            "model's requirements (the runtime provides modelfleet)", package="modelfleet")
    # A symlink to the package directory brings in modelfleet's code and nothing else,
    # whether modelfleet is an editable checkout or installed in site-packages.
    target.symlink_to(Path(modelfleet.__file__).resolve().parent, target_is_directory=True)


def _version_of_this_interpreter() -> str:
    impl = sys.implementation.name
    return f"{impl}-{'.'.join(str(n) for n in sys.version_info[:3])}"


def _interpreter(env: Path) -> Path:
    return env / "bin" / "python"


def _complete(env: Path) -> bool:
    """Built to the end, and its interpreter still runs from here (base python present)."""
    return (env / MARKER).is_file() and _interpreter(env).exists()


def _write_marker(env: Path, record: dict[str, object]) -> None:
    partial = env / f"{MARKER}.partial"
    partial.write_text(json.dumps(record, indent=2), encoding="utf-8")
    os.replace(partial, env / MARKER)  # atomic: the marker is whole or absent


@contextlib.asynccontextmanager
async def _exclusive(path: Path) -> AsyncIterator[None]:
    """Hold an exclusive ``flock`` on ``path`` without blocking the event loop."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    acquire = asyncio.ensure_future(asyncio.to_thread(fcntl.flock, fd, fcntl.LOCK_EX))
    try:
        await asyncio.shield(acquire)
    except BaseException:
        # Cancelled while the thread waits: once it gets the lock, closing releases it.
        acquire.add_done_callback(lambda _: os.close(fd))
        raise
    try:
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock
