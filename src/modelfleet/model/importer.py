"""Import a package's handler class, named by its manifest's ``entrypoint``."""

from __future__ import annotations

import ast
import contextlib
import hashlib
import importlib.abc
import importlib.machinery
import importlib.util
import inspect
import os
import re
import sys
import threading
from collections import OrderedDict
from pathlib import Path
from types import CodeType, ModuleType
from typing import Any

from modelfleet.errors import ModelLoadFailed
from modelfleet.model.api import Model
from modelfleet.repository.manifest import Manifest

_IMPORT_LOCK = threading.Lock()  # sys.path and sys.modules are process-wide
# Imports of a handler's frameworks, one thread at a time (taken before _IMPORT_LOCK).
# Python's per-module import locks take two threads importing parts of one package tree
# each other holds (two loads at once, one importing scikit-learn, which imports numpy,
# the other numpy) for a deadlock, and hand one of them the module half made: a load
# then failed with "partially initialized module 'numpy' has no attribute 'ndarray'".
_FRAMEWORK_LOCK = threading.RLock()
# Entrypoint sources compiled, by their bytes' digest: (code, top-level imports). A
# catalog of thousands of models often ships one handler.py thousands of times, and a
# runtime reloads a model it evicted: profiled at 5,000 models, compiling and parsing
# the same source again was a tenth of a runtime's CPU. Bounded, least recent out.
# The package's own modules beside it (``helpers.py``) come from the same cache.
_COMPILED: OrderedDict[bytes, tuple[CodeType, frozenset[str]]] = OrderedDict()
_COMPILED_LOCK = threading.Lock()
COMPILED_KEPT = 256


def import_framework(name: str) -> ModuleType:
    """Import a framework the runtime needs for a model itself (torch, to ask whether
    CUDA is there), one thread at a time with the handlers' own framework imports."""
    module = sys.modules.get(name)
    if module is not None:
        return module
    with _FRAMEWORK_LOCK:
        return importlib.import_module(name)


def import_handler(manifest: Manifest, package_dir: Path) -> type[Model]:
    """Import the handler class named by ``entrypoint = "module:Class"``.

    The entrypoint module is imported under a name unique to the model and version,
    so two packages may both ship a ``handler.py``. Sibling modules it imports from
    its package folder are removed from ``sys.modules`` afterwards (the handler keeps
    its references), so the next package's ``helpers.py`` is its own, not this one's.
    """
    module_name, _, class_name = manifest.entrypoint.partition(":")
    source = package_dir / (module_name.replace(".", os.sep) + ".py")
    if not source.is_file():
        raise ModelLoadFailed(f"model '{manifest.name}': entrypoint module {source} not found")
    identity = f"{manifest.name}:{manifest.version}:{module_name}:{package_dir}"
    digest = hashlib.sha256(identity.encode()).hexdigest()[:10]
    unique = "modelfleet_pkg_" + re.sub(r"\W", "_", f"{manifest.name}_{module_name}") + \
        f"_{digest}"
    spec = importlib.util.spec_from_file_location(unique, source)
    if spec is None or spec.loader is None:
        raise ModelLoadFailed(f"model '{manifest.name}': cannot import {source}")
    module: ModuleType = importlib.util.module_from_spec(spec)
    try:
        code, imports = _compiled(source)
    except (OSError, SyntaxError, ValueError) as exc:
        raise ModelLoadFailed(
            f"model '{manifest.name}': importing {source} failed: {exc!r}") from exc
    complete = _import_dependencies(imports, package_dir)
    # Its own code runs under the framework lock too unless every framework it names is
    # imported already (then it imports nothing that another load could be importing).
    with _FRAMEWORK_LOCK if not complete else contextlib.nullcontext(), _IMPORT_LOCK:
        before = set(sys.modules)
        sys.modules[unique] = module
        sys.path.insert(0, str(package_dir))
        siblings = _SiblingFinder(package_dir)
        sys.meta_path.insert(0, siblings)
        try:
            exec(code, module.__dict__)  # what the loader's exec_module does with it
        except Exception as exc:
            sys.modules.pop(unique, None)
            raise ModelLoadFailed(
                f"model '{manifest.name}': importing {source} failed: {exc!r}") from exc
        finally:
            sys.meta_path.remove(siblings)
            sys.path.remove(str(package_dir))
            _forget_package_siblings(set(sys.modules) - before - {unique}, package_dir)
    handler = getattr(module, class_name, None)
    if not (isinstance(handler, type) and issubclass(handler, Model)):
        raise ModelLoadFailed(
            f"model '{manifest.name}': {manifest.entrypoint} is not a modelfleet.Model subclass"
        )
    for hook in ("preprocess", "postprocess"):
        if not inspect.iscoroutinefunction(getattr(handler, hook)):
            raise ModelLoadFailed(f"model '{manifest.name}': {class_name}.{hook} must be "
                                  f"'async def' (it runs on the runtime's event loop)")
    return handler


def _compiled(source: Path) -> tuple[CodeType, frozenset[str]]:
    """The entrypoint's code, named for ``source``, and the modules its top level imports;
    compiled once per distinct source (``_COMPILED``)."""
    data = source.read_bytes()
    key = hashlib.sha256(data).digest()
    with _COMPILED_LOCK:
        cached = _COMPILED.get(key)
        if cached is not None:
            _COMPILED.move_to_end(key)
    if cached is None:
        tree = ast.parse(data, str(source))
        cached = (compile(tree, str(source), "exec", dont_inherit=True),
                  _top_level_imports(tree))
        with _COMPILED_LOCK:
            _COMPILED[key] = cached
            while len(_COMPILED) > COMPILED_KEPT:
                _COMPILED.popitem(last=False)
    code, imports = cached
    return _named(code, str(source)), imports


class _SiblingFinder(importlib.abc.MetaPathFinder):
    """Finds a top-level module that is a file of the package (``helpers.py``) while its
    entrypoint is imported, and loads it through ``_compiled``; anything else (a folder
    package, a framework) is left to the usual finders."""

    def __init__(self, package_dir: Path) -> None:
        self._dir = package_dir

    def find_spec(self, fullname: str, path: Any = None,
                  target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if path is not None or "." in fullname:
            return None
        source = self._dir / f"{fullname}.py"
        if not source.is_file():
            return None
        return importlib.util.spec_from_file_location(fullname, source,
                                                      loader=_CompiledLoader(source))


class _CompiledLoader(importlib.abc.Loader):
    def __init__(self, source: Path) -> None:
        self._source = source

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return None  # the default module

    def exec_module(self, module: ModuleType) -> None:
        code, _ = _compiled(self._source)
        exec(code, module.__dict__)


def _named(code: CodeType, filename: str) -> CodeType:
    """``code`` with every code object in it naming ``filename`` (tracebacks and
    ``__file__``-relative reads name this package's file, not the first one compiled)."""
    if code.co_filename == filename:
        return code
    consts = tuple(_named(c, filename) if isinstance(c, CodeType) else c
                   for c in code.co_consts)
    return code.replace(co_filename=filename, co_consts=consts)


def _top_level_imports(tree: ast.Module) -> frozenset[str]:
    names: set[str] = set()
    for node in tree.body:  # module level only: imports inside functions stay lazy
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
    return frozenset(names)


def _import_dependencies(names: frozenset[str], package_dir: Path) -> bool:
    """Import the entrypoint's top-level third-party imports (numpy, sklearn, torch) before
    the import lock is taken, so that one model's framework import (seconds) does not hold
    up another model's load behind the lock (measured: banner, pure Python, waited 3.7 s for
    iris's scikit-learn import after a runtime restart). Best effort, only a head start:
    anything missed or failing here is imported, or fails, under the lock as before.

    Those imports take ``_FRAMEWORK_LOCK``, one thread at a time; a model whose
    frameworks are all imported already takes no lock here. True when every one it
    names is imported now."""
    missing = []
    complete = True
    for name in sorted(names):
        top = name.partition(".")[0]
        if top in sys.modules and name in sys.modules:
            continue
        if (package_dir / f"{top}.py").exists() or (package_dir / top).is_dir():
            # The package's own module: imported under the lock, from its folder; what
            # it imports in turn is not known here.
            complete = False
            continue
        missing.append(name)
    if not missing:
        return complete
    with _FRAMEWORK_LOCK:
        for name in missing:
            try:
                importlib.import_module(name)
            except Exception:  # reported by the real import, under the lock
                complete = False
    return complete


def _forget_package_siblings(names: set[str], package_dir: Path) -> None:
    if not names:
        return
    root = package_dir.resolve()
    for name in names:
        origin = getattr(sys.modules.get(name), "__file__", None)
        if origin and Path(origin).resolve().is_relative_to(root):
            del sys.modules[name]
