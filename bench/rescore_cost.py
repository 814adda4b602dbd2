"""What one re-score of the worker coordinator costs as the catalog grows, candidates fixed.

A real coordinator over the embedded broker and one in-process runtime; the catalog
holds ``--candidates`` real packages, each with a task waiting and its demand heard,
and filler entries up to each size in ``--sizes`` (entries nobody asks for: what most
of a big repository is). Times ``observe`` + ``decide`` (acting would change the
state between repetitions), both the periodic kind (every candidate counted) and the
woken kind (only what was announced), and prints the median per re-score.

    PYTHONPATH=src .venv/bin/python bench/rescore_cost.py [--sizes 1000 10000 100000]

A second table: as many more models in demand with nothing waiting (their gateways
say so), how many queues one periodic re-score asks the broker to count (on RabbitMQ a
passive declare each, ~0.6 ms) and what it costs.

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

from modelfleet.broker import QueueStats
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


class CountingBroker(MemoryBroker):
    """The embedded broker, counting the queues it is asked to count (on RabbitMQ, one
    passive declare each)."""

    counted = 0

    async def queue_stats(self, model_ids: list[str]) -> dict[str, QueueStats]:
        self.counted += len(model_ids)
        return await super().queue_stats(model_ids)


async def measure(size: int, candidates: int, repeats: int,
                  announced: int = 0) -> tuple[float, float, float, int]:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        names = write_repo(root / "repo", candidates)
        settings = Settings(repo=str(root / "repo"), state_dir=root / "state",
                            broker={"url": "memory"}, worker={"worker_id": "w-bench"})
        store, real = open_repository(settings)
        catalog = Catalog({**filler(size - len(real)), **{e.model_id: e for e in real}})
        broker = CountingBroker(settings.broker)
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
            quiet = [f"filler-{i:06d}" for i in range(announced)]
            figures = []
            for full in (True, False):
                times = []
                broker.counted = 0
                for _ in range(repeats):
                    # Heard again: still in demand, announced anew (with how many wait,
                    # as gateways now say; a build that does not read it ignores it).
                    for name, waiting in [*((n, 1) for n in names), *((n, 0) for n in quiet)]:
                        coordinator._demand[name] = time.time()
                        coordinator._dirty.add(name)
                        if hasattr(coordinator, "_announced"):
                            coordinator._announced.observe(
                                {"kind": "demand", "model_id": name, "waiting": waiting,
                                 "gateway": "g"}, coordinator._clock())
                    started = time.perf_counter()
                    snapshot = await coordinator._observe(full)
                    assert snapshot is not None
                    decide(snapshot, settings.scheduling, 0)
                    times.append(time.perf_counter() - started)
                    if len(times) == 1:
                        first_counted, broker.counted = broker.counted, 0
                figures.append(statistics.median(times[1:]))
                if full:
                    counted = broker.counted / (repeats - 1)
                    exact = first_counted
            return figures[0], figures[1], counted, exact
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
    parser.add_argument("--announced", type=int, nargs="+", default=[0, 500, 2_000],
                        help="models also in demand with nothing waiting (second table)")
    args = parser.parse_args(argv)
    print(f"# one re-score (observe + decide), {args.candidates} candidates with a task "
          f"each, median of {args.repeats}; python {sys.version.split()[0]}")
    print("| catalog | periodic ms | woken ms |")
    print("|---:|---:|---:|")
    for size in args.sizes:
        full, woken, _, _ = asyncio.run(measure(size, args.candidates, args.repeats))
        print(f"| {size:,} | {full * 1e3:.2f} | {woken * 1e3:.2f} |", flush=True)
    size = max(args.sizes)
    print(f"\n# {size:,} models; more models announced in demand, nothing waiting in them:"
          " queues counted on the broker per periodic re-score (the first one, and one"
          " every EXACT_EVERY_S, counts every candidate)")
    print("| also announced | queues counted, first | then, per re-score | periodic ms |")
    print("|---:|---:|---:|---:|")
    for announced in args.announced:
        full, _, counted, exact = asyncio.run(measure(size, args.candidates, args.repeats,
                                                      announced))
        print(f"| {announced:,} | {exact:,} | {counted:.0f} | {full * 1e3:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
