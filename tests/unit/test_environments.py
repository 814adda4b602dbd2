"""Per-model environments: naming, requirements, uv's errors, and real builds with uv.

The builds are real (uv, the configured index, uv's shared cache) and few: every
test that builds shares one session-wide ``venv_root``, and the two example pins
(six 1.15.0 and 1.16.0) are the only successful environments built.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

import pytest

from modelfleet.errors import ManifestError, ModelLoadFailed
from modelfleet.repository.manifest import load_manifest
from modelfleet.worker.isolation.environments import (
    MARKER,
    EnvironmentBuilder,
    EnvironmentBuildFailed,
    IndexConfig,
    diagnose,
    environment_hash,
    normalise_requirement,
    normalise_requirements,
    requirements_for,
    venv_process_env,
)

ROOT = Path(__file__).resolve().parents[2]
OLD = ROOT / "examples" / "models" / "pinned-old" / "1"
NEW = ROOT / "examples" / "models" / "pinned-new" / "1"


class Lines(list[str]):
    """A progress callback that keeps what it was told."""

    def __call__(self, line: str) -> None:
        self.append(line)

    def builds(self) -> int:
        return sum(line.startswith("building environment ") for line in self)


def pins(package: Path) -> tuple[str, ...]:
    return requirements_for(package, load_manifest(package / "model.toml"))


async def run(python: Path, code: str, *args: str) -> str:
    process = await asyncio.create_subprocess_exec(
        str(python), "-c", code, *args, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT, env=venv_process_env(os.environ), cwd="/")
    out, _ = await process.communicate()
    assert process.returncode == 0, out.decode()
    return out.decode().strip()


# --- naming: normalised requirements and the hash ---------------------------------------


@pytest.mark.parametrize(("line", "normal"), [
    ("six==1.16.0", "six==1.16.0"),
    ("  Six == 1.16.0  ", "six==1.16.0"),
    ("Foo.Bar_baz>=1.0 , <2", "foo-bar-baz<2,>=1.0"),
    ("requests[Socks, security]>=2", "requests[security,socks]>=2"),
    ("numpy>=1.26 ;  python_version < '3.12'", 'numpy>=1.26; python_version < "3.12"'),
    ("pkg @ https://example.com/pkg-1.0.tar.gz", "pkg @ https://example.com/pkg-1.0.tar.gz"),
    ("six==1.16.0  # the comment goes", "six==1.16.0"),
])
def test_requirements_are_spelled_one_way(line: str, normal: str) -> None:
    assert normalise_requirement(line) == normal


@pytest.mark.parametrize("line", ["--index-url http://evil/simple", "-r other.txt",
                                  "==1.0", "six==", "six 1.0"])
def test_options_and_garbage_are_not_requirements(line: str) -> None:
    with pytest.raises(ValueError):
        normalise_requirement(line)


def test_normalised_requirements_are_sorted_unique_and_skip_comments() -> None:
    lines = ["# pins", "six==1.16.0", "", "SIX == 1.16.0", "attrs>=23"]
    assert normalise_requirements(lines) == ("attrs>=23", "six==1.16.0")


def test_the_hash_ignores_spelling_and_order() -> None:
    assert (environment_hash(["Six == 1.16.0", "attrs>=23"], "cpython-3.11.7")
            == environment_hash(["attrs>=23", "six==1.16.0", "six==1.16.0"], "cpython-3.11.7"))


def test_the_hash_changes_with_pins_python_and_runtime_needs() -> None:
    base = environment_hash(["six==1.16.0"], "cpython-3.11.7", ["msgpack>=1.0"])
    assert base != environment_hash(["six==1.15.0"], "cpython-3.11.7", ["msgpack>=1.0"])
    assert base != environment_hash(["six==1.16.0"], "cpython-3.12.1", ["msgpack>=1.0"])
    assert base != environment_hash(["six==1.16.0"], "cpython-3.11.7", ["msgpack>=1.1"])


def test_the_hash_is_stable_across_releases() -> None:
    # Every environment already built is found by this value: changing the recipe
    # means a rebuild of each, so it must be on purpose (bump LAYOUT).
    assert environment_hash(["six==1.16.0"], "cpython-3.11.7", ["msgpack>=1.0"]) == (
        "3885e9253073e654f4cecc5bcc4da9a690444d5b8c58684f5b480385c854b6d9")


# --- a model's requirements ---------------------------------------------------------------


def package(tmp_path: Path, requirements: list[str], txt: str | None) -> Path:
    (tmp_path / "model.toml").write_text(
        f'name = "m"\nentrypoint = "handler:M"\n[isolation]\nrequirements = {requirements!r}\n'
        .replace("'", '"'))
    if txt is not None:
        (tmp_path / "requirements.txt").write_text(txt)
    return tmp_path


def test_requirements_merge_the_manifest_and_requirements_txt(tmp_path: Path) -> None:
    folder = package(tmp_path, ["six==1.16.0"], "# shipped\nattrs >= 23\n\nSix==1.16.0\n")
    assert pins(folder) == ("attrs>=23", "six==1.16.0")


def test_the_example_models_pin_different_six() -> None:
    assert pins(OLD) == ("six==1.15.0",)
    assert pins(NEW) == ("six==1.16.0",)


def test_a_bad_line_is_reported_with_its_file_and_line(tmp_path: Path) -> None:
    folder = package(tmp_path, [], "six==1.16.0\n--extra-index-url http://x/simple\n")
    with pytest.raises(ManifestError, match=r"requirements\.txt: field 'line 2': .*pip options"):
        pins(folder)
    folder = package(tmp_path, ["six=="], None)
    (tmp_path / "requirements.txt").unlink()
    with pytest.raises(ManifestError, match=r"field 'isolation\.requirements\.0'"):
        pins(folder)


# --- where uv looks: pip's configuration ---------------------------------------------------


def test_uv_gets_pips_index_settings(tmp_path: Path) -> None:
    conf = tmp_path / "pip.conf"
    conf.write_text("[global]\nextra-index-url = file:///opt/a/simple file:///opt/b/simple\n"
                    "find-links = /opt/wheels\nconstraint = /etc/c.txt\n"
                    "[install]\nindex_url = https://mirror.example/simple\n")
    index = IndexConfig.from_pip(environ={"PIP_FIND_LINKS": "/srv/wheels"}, files=[conf])
    assert index == IndexConfig(index_url="https://mirror.example/simple",
                                extra_index_urls=("file:///opt/a/simple", "file:///opt/b/simple"),
                                find_links=("/srv/wheels",), constraints=("/etc/c.txt",))
    assert index.uv_args() == [
        "--index-url", "https://mirror.example/simple",
        "--extra-index-url", "file:///opt/a/simple", "--extra-index-url", "file:///opt/b/simple",
        "--index-strategy", "unsafe-best-match",  # pip's behaviour across indexes
        "--find-links", "/srv/wheels", "--constraints", "/etc/c.txt"]


def test_an_explicit_index_url_overrides_pip(tmp_path: Path) -> None:
    builder = EnvironmentBuilder(tmp_path, index_url="https://other.example/simple",
                                 index=IndexConfig(find_links=("/w",)))
    assert builder.index == IndexConfig(index_url="https://other.example/simple",
                                        find_links=("/w",))


# --- reading uv's errors (its real messages) ------------------------------------------------


@pytest.mark.parametrize(("output", "package", "reason"), [
    ("error: No solution found when resolving dependencies\n  cause: Because definitely-not-a-"
     "package-xyz was not found in the package registry and you require definitely-not-a-"
     "package-xyz==1.0, we can conclude that your requirements are unsatisfiable.",
     "definitely-not-a-package-xyz", "no such package on the index"),
    ("  cause: Because there is no version of six==99 and you require six==99, we can conclude",
     "six", "no version matches"),
    ("  cause: Because only six<=1.17.0 is available and you require six>=99, we can conclude",
     "six", "no version matches"),
    ("  cause: Because pydantic==2.0 depends on pydantic-core==2.0.1 and you require "
     "pydantic==2.0, we can conclude that you require pydantic-core==2.0.1.\n And because you "
     "require pydantic-core==2.50.5, we can conclude", "pydantic", "conflicting requirements"),
    ("error: Failed to build `numpy==1.16.0`\n  cause: The build backend returned an error",
     "numpy", "it failed to build or download"),
    ("error: Request failed after 3 retries\n  cause: Failed to fetch: http://127.0.0.1:9/simple/",
     None, "the package index could not be reached"),
])
def test_uv_errors_name_the_package(output: str, package: str | None, reason: str) -> None:
    requested = ["definitely-not-a-package-xyz==1.0", "six==99", "pydantic==2.0",
                 "pydantic-core==2.50.5", "numpy==1.16.0"]
    assert diagnose(output, requested) == (package, reason)


# --- real builds -----------------------------------------------------------------------------


@pytest.fixture(scope="session")
def venv_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("venvs")


async def test_concurrent_ensures_build_once_and_later_ones_run_no_uv(tmp_path: Path) -> None:
    venv_root = tmp_path  # its own root: this test must see the one build happen
    first, second = Lines(), Lines()
    builder = EnvironmentBuilder(venv_root)
    a, b = await asyncio.gather(builder.ensure(pins(OLD), first),
                                builder.ensure(pins(OLD), second))
    assert a == b
    assert a.parent.parent.parent == venv_root and (a.parent.parent / MARKER).is_file()
    assert first.builds() + second.builds() == 1
    tag = a.parent.parent.name[:12]
    assert (first + second)[0] == f"building environment {tag} for: six==1.15.0"

    again = Lines()  # a new builder: another worker process, or a restart
    assert await EnvironmentBuilder(venv_root).ensure(["SIX == 1.15.0"], again) == a
    assert again == []  # no build, no uv


async def test_an_environment_has_modelfleet_its_pin_and_nothing_of_the_main_venv(
        venv_root: Path) -> None:
    python = await EnvironmentBuilder(venv_root).ensure(pins(OLD), Lines())
    code = ("import importlib.util, modelfleet.runtime.server, six; "
            "print(six.__version__, importlib.util.find_spec('fastapi') is None)")
    assert await run(python, code) == "1.15.0 True"


async def test_two_pins_two_environments_served_side_by_side(venv_root: Path) -> None:
    builder = EnvironmentBuilder(venv_root)
    old, new = await asyncio.gather(builder.ensure(pins(OLD), Lines()),
                                    builder.ensure(pins(NEW), Lines()))
    assert old != new
    serve = ("import json, sys; from modelfleet import LocalModel; "
             "print(json.dumps(LocalModel.from_package(sys.argv[1])"
             ".infer(b'{\"any\": 1}', 'application/json')))")
    answers = await asyncio.gather(run(old, serve, str(OLD)), run(new, serve, str(NEW)))
    assert [json.loads(a) for a in answers] == [{"package": "six", "version": "1.15.0"},
                                                {"package": "six", "version": "1.16.0"}]


async def test_an_unresolvable_requirement_fails_naming_the_package(venv_root: Path) -> None:
    progress = Lines()
    with pytest.raises(EnvironmentBuildFailed) as caught:
        await EnvironmentBuilder(venv_root).ensure(
            ["six==1.16.0", "definitely-not-a-package-xyz==1.0"], progress)
    error = caught.value
    assert isinstance(error, ModelLoadFailed) and error.code == "model_load_failed"
    assert error.package == "definitely-not-a-package-xyz"
    assert str(error).startswith("cannot install 'definitely-not-a-package-xyz': "
                                 "no such package on the index")
    assert "--- uv said ---" in str(error) and "was not found" in error.uv_output
    assert progress.builds() == 1
    assert all_complete(venv_root)  # the failed build left no half-built environment behind


def all_complete(venv_root: Path) -> bool:
    return all((p / MARKER).is_file() for p in venv_root.iterdir() if p.is_dir())


async def test_a_build_that_died_before_its_marker_is_built_again(venv_root: Path) -> None:
    python = await EnvironmentBuilder(venv_root).ensure(pins(NEW), Lines())
    (python.parent.parent / MARKER).unlink()  # as if the worker died mid-build
    progress = Lines()
    assert await EnvironmentBuilder(venv_root).ensure(pins(NEW), progress) == python
    assert progress.builds() == 1
    assert progress[-1].endswith("s") and "ready in" in progress[-1]
    assert await run(python, "import six; print(six.__version__)") == "1.16.0"


async def test_two_worker_processes_build_one_environment_between_them(tmp_path: Path) -> None:
    worker = ("import asyncio, sys; from pathlib import Path; "
              "from modelfleet.worker.isolation.environments import EnvironmentBuilder; "
              "builder = EnvironmentBuilder(Path(sys.argv[1])); "
              "print(asyncio.run(builder.ensure(sys.argv[2:], print)))")
    argv = [sys.executable, "-c", worker, str(tmp_path), *pins(OLD)]
    outputs = await asyncio.gather(*(run_argv(argv) for _ in range(2)))
    lines = [line for out in outputs for line in out.splitlines()]
    assert sum(line.startswith("building environment ") for line in lines) == 1
    assert outputs[0].splitlines()[-1] == outputs[1].splitlines()[-1]  # the same interpreter


async def run_argv(argv: list[str]) -> str:
    process = await asyncio.create_subprocess_exec(*argv, stdout=asyncio.subprocess.PIPE,
                                                   stderr=asyncio.subprocess.STDOUT)
    out, _ = await process.communicate()
    assert process.returncode == 0, out.decode()
    return out.decode()
