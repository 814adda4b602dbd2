"""One model's framework import does not hold up another model's load behind the import lock."""

from __future__ import annotations

import sys
import textwrap
import threading
import time
import traceback
from pathlib import Path

import pytest

from modelfleet.errors import ModelLoadFailed
from modelfleet.model.importer import import_handler
from modelfleet.repository.manifest import load_manifest
from tests.procs import write_package
from tests.waiting import eventually_blocking

MANIFEST = '''
    name = "{name}"
    version = "1"
    entrypoint = "handler:Handler"
    accepts = ["text/plain"]
'''
HEAVY = '''
    import heavy_framework_for_test  # a framework whose import takes a while

    from modelfleet import Model


    class Handler(Model):
        pass
'''
LIGHT = '''
    from modelfleet import Model


    class Handler(Model):
        pass
'''


def test_a_light_handler_imports_while_a_heavy_ones_framework_is_importing(
        tmp_path: Path) -> None:
    site = tmp_path / "site"
    site.mkdir()
    started = tmp_path / "started"
    (site / "heavy_framework_for_test.py").write_text(
        f"import pathlib, time\npathlib.Path({str(started)!r}).touch()\ntime.sleep(3)\n")
    heavy = write_package(tmp_path / "repo", "heavy", MANIFEST.format(name="heavy"), HEAVY)
    light = write_package(tmp_path / "repo", "light", MANIFEST.format(name="light"), LIGHT)
    sys.path.insert(0, str(site))
    try:
        done: dict[str, float] = {}

        def load(folder: Path) -> None:
            import_handler(load_manifest(folder / "model.toml"), folder)
            done[folder.parent.name] = time.monotonic()

        slow = threading.Thread(target=load, args=(heavy,))
        slow.start()
        eventually_blocking(started.exists, 30, every_s=0.01,  # its import is under way
                            what="the framework's import started")
        load(light)
        slow.join()
        assert done["light"] < done["heavy"]  # it did not wait for the framework
    finally:
        sys.path.remove(str(site))
        sys.modules.pop("heavy_framework_for_test", None)



FRAMEWORK = '''
import pathlib, time
log = pathlib.Path({log!r})
with log.open("a") as out:
    out.write("{name} started\\n")
time.sleep(0.5)
with log.open("a") as out:
    out.write("{name} done\\n")
'''
USES = '''
    import {framework}

    from modelfleet import Model


    class Handler(Model):
        pass
'''


def test_two_loads_import_their_frameworks_one_after_the_other(tmp_path: Path) -> None:
    """Two loads at once whose frameworks are not imported yet (a restarted runtime
    reloading iris, through scikit-learn, and another model importing numpy) import them
    one at a time: Python's module locks take two threads importing parts of one package
    tree each holds for a deadlock and hand one a module half made (a load failed with
    "partially initialized module 'numpy' has no attribute 'ndarray'")."""
    site, log = tmp_path / "site", tmp_path / "imports.log"
    site.mkdir()
    for name in ("framework_one_for_test", "framework_two_for_test"):
        (site / f"{name}.py").write_text(FRAMEWORK.format(log=str(log), name=name))
    one = write_package(tmp_path / "repo", "one", MANIFEST.format(name="one"),
                        USES.format(framework="framework_one_for_test"))
    two = write_package(tmp_path / "repo", "two", MANIFEST.format(name="two"),
                        USES.format(framework="framework_two_for_test"))
    sys.path.insert(0, str(site))
    try:
        first = threading.Thread(
            target=import_handler, args=(load_manifest(one / "model.toml"), one))
        first.start()
        eventually_blocking(log.exists, 30, every_s=0.01, what="the first import started")
        import_handler(load_manifest(two / "model.toml"), two)
        first.join(30)
        assert log.read_text().splitlines() == [
            "framework_one_for_test started", "framework_one_for_test done",
            "framework_two_for_test started", "framework_two_for_test done"]
    finally:
        sys.path.remove(str(site))
        for name in ("framework_one_for_test", "framework_two_for_test"):
            sys.modules.pop(name, None)


COUNTER = '''
    from modelfleet import Model

    from helpers import calls  # the package's own module beside it


    class Handler(Model):
        def boom(self):
            raise RuntimeError("from " + __name__)

        def count(self):
            calls.append(1)
            return len(calls)
'''


def test_one_source_compiled_once_still_gives_each_package_its_own_module_and_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    compiled: list[str] = []
    real_compile = compile

    def counting_compile(source, filename, *args, **kwargs):  # type: ignore[no-untyped-def]
        compiled.append(str(filename))
        return real_compile(source, filename, *args, **kwargs)

    monkeypatch.setattr("builtins.compile", counting_compile)
    folders = [write_package(tmp_path / "repo", name, MANIFEST.format(name=name), COUNTER)
               for name in ("one", "two")]
    for folder in folders:
        (folder / "helpers.py").write_text("calls = []\n")
    handlers = [import_handler(load_manifest(f / "model.toml"), f) for f in folders]
    # The same bytes: parsed and compiled for the first package only.
    assert set(compiled) == {str(folders[0] / "handler.py"), str(folders[0] / "helpers.py")}
    before = len(compiled)
    one, two = (h() for h in handlers)
    assert one.count() == 1 and one.count() == 2 and two.count() == 1  # modules apart
    for folder, handler in zip(folders, handlers, strict=True):
        with pytest.raises(RuntimeError) as raised:
            handler().boom()
        frames = traceback.extract_tb(raised.value.__traceback__)
        assert frames[-1].filename == str(folder / "handler.py")  # its own file, not one's
    # A package whose handler changed is compiled afresh.
    (folders[1] / "handler.py").write_text(textwrap.dedent(COUNTER) + "\nNEW = 1\n")
    changed = import_handler(load_manifest(folders[1] / "model.toml"), folders[1])
    assert len(compiled) > before and set(compiled[before:]) == {str(folders[1] / "handler.py")}
    assert sys.modules[changed.__module__].NEW == 1


def test_a_handler_that_does_not_compile_fails_its_load_with_the_file_named(
        tmp_path: Path) -> None:
    folder = write_package(tmp_path / "repo", "broken", MANIFEST.format(name="broken"),
                           "from modelfleet import Model\n\nclass Handler(Model:\n    pass\n")
    with pytest.raises(ModelLoadFailed, match=r"model 'broken': importing .*handler\.py "
                                              r"failed: SyntaxError"):
        import_handler(load_manifest(folder / "model.toml"), folder)
