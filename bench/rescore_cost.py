"""What one re-score of the worker coordinator costs as the catalog grows, candidates fixed.

A real coordinator over the embedded broker and one in-process runtime; the catalog
holds ``--candidates`` real packages, each with a task waiting and its demand heard,
and filler entries up to each size in ``--sizes`` (entries nobody asks for: what most
of a big repository is). Times ``observe`` + ``decide`` (acting would change the
state between repetitions), both the periodic kind (every candidate counted) and the
woken kind (only what was announced), and prints the median per re-score.

    PYTHONPATH=src .venv/bin/python bench/rescore_cost.py [--sizes 1000 10000 100000]

Run it with another tree first on PYTHONPATH to compare builds (it uses nothing newer
than the coordinator's own re-score).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import textwrap
import time
import uuid
from pathlib import Path

from modelfleet.broker.embedded import MemoryBroker
from modelfleet.launch import open_repository
from modelfleet.messages import PayloadRef, Task, now_ms
from modelfleet.repository import Catalog, CatalogEntry
from modelfleet.repository.manifest import Manifest
from modelfleet.runtime.inprocess import InProcessLauncher
from modelfleet.scheduling import decide
from modelfleet.settings import Settings
from modelfleet.worker.coordinator import Coordinator
from modelfleet.worker.supervisor import RuntimeSupervisor

HANDLER = '''
from modelfleet import Model

class Echo(Model):
    def predict(self, batch):
        return batch
'''


def write_repo(root: Path, candidates: int) -> list[str]:
    names = [f"cand-{i:03d}" for i in range(candidates)]
    for name in names:
        folder = root / name / "1"
        folder.mkdir(parents=True)
        (folder / "model.toml").write_text(textwrap.dedent(f'''
            name = "{name}"
            version = "1"
            entrypoint = "handler:Echo"
        '''))
        (folder / "handler.py").write_text(HANDLER)
    return names


def filler(count: int) -> dict[str, CatalogEntry]:
    """Entries nobody asks for (none pinned: a pinned model is a candidate everywhere)."""
    base = Manifest(name="filler", entrypoint="handler:Echo")
    return {f"filler-{i:06d}": CatalogEntry((base.model_copy(
        update={"name": f"filler-{i:06d}"}),)) for i in range(count)}


async def measure(size: int, candidates: int, repeats: int) -> tuple[float, float]:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        names = write_repo(root / "repo", candidates)
        settings = Settings(repo=str(root / "repo"), state_dir=root / "state",
                            broker={"url": "memory"}, worker={"worker_id": "w-bench"})
        store, real = open_repository(settings)
        catalog = Catalog({**filler(size - len(real)), **{e.model_id: e for e in real}})
        broker = MemoryBroker(settings.broker)
        await broker.connect()
        launcher = InProcessLauncher()
        supervisor = RuntimeSupervisor(settings, catalog, store, launcher=launcher)
        await supervisor.start()
        coordinator = Coordinator(settings, broker, catalog, supervisor)
        try:
            for name in names:
                body = b"x"
                await broker.publish_task(Task(
                    uuid.uuid4().hex, name, "1", now_ms() + 600_000, "nobody",
                    PayloadRef("inline", data=body, size_bytes=1), "text/plain", now_ms()))
            figures = []
            for full in (True, False):
                times = []
                for _ in range(repeats):
                    for name in names:  # heard again: still in demand, announced anew
                        coordinator._demand[name] = time.time()
                        coordinator._dirty.add(name)
                    started = time.perf_counter()
                    snapshot = await coordinator._observe(full)
                    assert snapshot is not None
                    decide(snapshot, settings.scheduling, 0)
                    times.append(time.perf_counter() - started)
                figures.append(statistics.median(times[1:]))
            return figures[0], figures[1]
        finally:
            if coordinator._pinning is not None:
                coordinator._pinning.cancel()
            await supervisor.stop()
            await launcher.close()
            await broker.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1_000, 10_000, 100_000])
    parser.add_argument("--candidates", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args(argv)
    print(f"# one re-score (observe + decide), {args.candidates} candidates, "
          f"median of {args.repeats}; python {sys.version.split()[0]}")
    print("| catalog | periodic (all counted) ms | woken (announced counted) ms |")
    print("|---:|---:|---:|")
    for size in args.sizes:
        full, woken = asyncio.run(measure(size, args.candidates, args.repeats))
        print(f"| {size:,} | {full * 1e3:.2f} | {woken * 1e3:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
