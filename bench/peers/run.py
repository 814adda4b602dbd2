"""modelfleet against its peers, side by side, on one generated catalog: `make bench-peers`.

    .venv/bin/python bench/peers/run.py [--quick] [--only plain,modelfleet,...]
                                        [--measure-s 45] [--warmup-s 5] [--skip-build]
                                        [--models 5000 | --scale] [--sizes small|large]
                                        [--mapped] [--venvs DIR] [--mf-venv DIR]
                                        [--mf-env MODELFLEET_X=V] [--results PATH]

The two final runs, bounded and with their expected wall time: bench/peers/final.sh.

The scale variant (`--models 5000`, or `--scale`; issue 23): 5,000 MLPs of 20 KB-1 MB,
zipf-32 only, the systems plain, mlserver, ray (800 models per replica: the same 16 %
share as modelfleet's budget), modelfleet and modelfleet-amqp, the latter on a private
RabbitMQ node (own ports, `ulimit -n 20000`, stopped after; `--private-rabbit`).

Systems (each in its own venv under bench/peers/.venvs, built on first use):
  plain            uvicorn + Starlette, all 50 models resident, 2 workers (the upper limit)
  mlserver         MLServer 1.7.1, custom runtime, all 50 models loaded, parallel_workers 2
  ray              Ray Serve, @serve.multiplexed(max_num_models_per_replica=8), 2 replicas
  modelfleet       modelfleet serve (embedded broker), 2 shared runtimes, device budget per
                   runtime 16 % of the catalog's bytes
  modelfleet-amqp  modelfleet gateway + worker over RabbitMQ, same settings
  modelfleet-fits  modelfleet serve with a device budget above the catalog's bytes
  amqp-rtt         bare aio-pika round trip (confirmed publish, quorum queue, reply), c1

Workloads per system, each by a separate load-generator process (keep-alive clients):
  zipf-32   32 closed-loop clients, model by Zipf s=1.0 over 50 ranks, 5 s warm-up, 45 s
  warm-c1   1 client on model-00 (warm), 5 s: p50
  warm-c32  32 clients on model-00, 10 s: req/s

Prints one markdown table with ratios, writes bench/peers/results/latest.json and a
timestamped copy. See bench/peers/README.md for how to read it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import hashlib
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import time
import traceback
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil

from modelfleet.devtools.rabbit_node import RabbitNode

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path.insert(0, str(HERE))

import catalog as cat  # noqa: E402
import optimum  # noqa: E402
import procs  # noqa: E402
import stats  # noqa: E402
from report import render  # noqa: E402

VENVS = HERE / ".venvs"  # the default; --venvs DIR (or $BENCH_PEERS_VENVS) for others
CACHE = HERE / ".cache"
RESULTS = HERE / "results"
SERVERS = HERE / "servers"
MODELFLEET_VENV = ROOT / ".venv"  # the default; --mf-venv DIR for another

PEER_REQUIREMENTS: dict[str, list[str]] = {
    "plain": ["uvicorn[standard]", "starlette", "numpy"],
    "mlserver": ["mlserver==1.7.1", "uvloop<0.22", "numpy"],  # 1.7.1 on 3.11 needs uvloop<0.22
    "ray": ["ray[serve]>=2,<3", "numpy"],
    "loadgen": ["aiohttp", "aio-pika", "numpy"],
}
PEER_PACKAGES: dict[str, list[str]] = {
    "plain": ["uvicorn", "starlette", "uvloop", "httptools", "numpy"],
    "mlserver": ["mlserver", "uvicorn", "fastapi", "uvloop", "numpy"],
    "ray": ["ray", "uvicorn", "starlette", "numpy"],
    "loadgen": ["aiohttp", "aio-pika", "numpy"],
    "modelfleet": ["modelfleet", "uvicorn", "fastapi", "aio-pika", "numpy"],
}
SYSTEMS = ["plain", "mlserver", "ray", "modelfleet", "modelfleet-amqp", "modelfleet-fits",
           "modelfleet-mapped", "amqp-rtt"]
DEFAULT_SYSTEMS = [s for s in SYSTEMS if s != "modelfleet-mapped"]  # --mapped adds it
SCALE_SYSTEMS = ["plain", "mlserver", "ray", "modelfleet", "modelfleet-amqp"]
PRIVATE_RABBIT_FROM = 300  # models: from here on the amqp row gets a RabbitMQ of its own
RABBIT_FD_LIMIT = 20_000  # the private node's `ulimit -n`
VENV_OF = {"plain": "plain", "mlserver": "mlserver", "ray": "ray"}
WORKLOADS = ["zipf-32", "warm-c1", "warm-c32"]
BUDGET_FRACTION = 0.16
FITS_FACTOR = 1.25
WORKERS = 2
KEEP_RUNS = 8  # run folders (logs, generated repository) kept under .cache/runs


class Interrupted(Exception):
    pass


def per_replica(n_models: int) -> int:
    """Models per Ray replica: the same share of the catalog as modelfleet's budget."""
    return max(1, round(BUDGET_FRACTION * n_models))


def catalog_dir(n_models: int, sizes: str) -> Path:
    if (n_models, sizes) == (cat.N_MODELS, "large"):
        return CACHE / "catalog"  # the default catalog's folder, as before
    return CACHE / f"catalog-{n_models}-{sizes}"


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# -- venvs ----------------------------------------------------------------------------------

def ensure_venv(name: str, python: str, skip_build: bool, root: Path = VENVS) -> Path:
    """<root>/<name> (bench/peers/.venvs/<name>), with its requirements installed (once: a
    stamp says so)."""
    venv = root / name
    reqs = PEER_REQUIREMENTS[name]
    digest = hashlib.sha256(json.dumps(reqs).encode()).hexdigest()[:12]
    stamp = venv / f".bench-installed-{digest}"
    if stamp.exists() and (venv / "bin" / "python").exists():
        return venv
    if skip_build:
        if (venv / "bin" / "python").exists():
            return venv
        raise SystemExit(f"--skip-build: {venv} is missing; run once without --skip-build")
    log(f"building venv {venv.relative_to(ROOT)}: {' '.join(reqs)} (first time: minutes)")
    if not (venv / "bin" / "python").exists():
        subprocess.run([python, "-m", "venv", str(venv)], check=True)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q",
           "--disable-pip-version-check"]
    subprocess.run([*pip, "--upgrade", "pip"], check=True)
    subprocess.run([*pip, *reqs], check=True)
    for old in venv.glob(".bench-installed-*"):
        old.unlink()
    stamp.touch()
    return venv


def versions_in(python: Path, packages: list[str]) -> dict[str, str]:
    code = ("import importlib.metadata as m, json, sys\n"
            "out = {'python': sys.version.split()[0]}\n"
            f"for p in {packages!r}:\n"
            "    try: out[p] = m.version(p)\n"
            "    except m.PackageNotFoundError: pass\n"
            "print(json.dumps(out))")
    try:
        done = subprocess.run([str(python), "-c", code], capture_output=True, text=True,
                              timeout=60, check=True)
        return dict(json.loads(done.stdout))
    except (subprocess.SubprocessError, ValueError) as exc:
        return {"error": repr(exc)}


def git_describe() -> dict[str, Any]:
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True,
                              check=False).stdout.strip()
    return {"commit": git("rev-parse", "HEAD"),
            "dirty_paths": [line[3:] for line in git("status", "--porcelain").splitlines()
                            if line[3:].startswith("src/")]}


# -- running one system ---------------------------------------------------------------------

@dataclass
class Running:
    servers: list[procs.Server]
    base: str
    protocol: str
    load_log: Path
    metrics_urls: list[str] = field(default_factory=list)
    settings: dict[str, Any] = field(default_factory=dict)
    cleanup: list[Callable[[], None]] = field(default_factory=list)


def probe_body(protocol: str) -> bytes:
    row = [0.1] * 64
    if protocol == "mlserver":
        return json.dumps({"inputs": [{"name": "x", "shape": [1, 64], "datatype": "FP32",
                                       "data": row}]}).encode()
    return json.dumps({"inputs": row}).encode()


def probe(protocol: str, base: str, model: str) -> Callable[[], bool]:
    headers = {"content-type": "application/json"}
    if protocol == "mlserver":
        url = f"{base}/v2/models/{model}/infer"
    elif protocol == "ray":
        url, headers = f"{base}/infer", {**headers, "serve_multiplexed_model_id": model}
    else:
        url = f"{base}/v1/models/{model}/infer"

    def ok() -> bool:
        try:
            return httpx.post(url, content=probe_body(protocol), headers=headers,
                              timeout=30).status_code == 200
        except httpx.HTTPError:
            return False
    return ok


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
        self.tag = f"{self.stamp}-{uuid.uuid4().hex[:6]}"
        self.run_dir = CACHE / "runs" / self.stamp
        self.run_dir.mkdir(parents=True, exist_ok=True)
        for old in sorted((CACHE / "runs").iterdir())[:-KEEP_RUNS]:  # logs of old runs
            shutil.rmtree(old, ignore_errors=True)
        low, high = cat.SIZE_PRESETS[args.sizes]
        self.catalog = cat.write_catalog(catalog_dir(args.models, args.sizes), n=args.models,
                                         min_bytes=low, max_bytes=high)
        self.sizes = self.catalog.sizes()
        self.total_bytes = sum(self.sizes.values())
        self.repo = cat.write_modelfleet_repo(self.catalog, self.run_dir / "repo")
        self.models = [m.name for m in self.catalog.models]
        self.hot = self.models[0]  # rank 0: the warm workloads' model and the probes'
        self.budget = int(self.total_bytes * BUDGET_FRACTION)  # per runtime
        self.pooled_budget = WORKERS * self.budget
        self.venvs: dict[str, Path] = {}
        self.current: Running | None = None  # the system being started or run
        self.broker_pids: list[int] = []  # a private RabbitMQ node's, while it runs
        self.systems: list[dict[str, Any]] = []  # results, in the order run

    def code_dir(self, system: str, files: list[str]) -> Path:
        """A folder holding mlp.py and the system's server files: the peer's path."""
        code = self.run_dir / system / "code"
        code.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(HERE / "mlp.py", code / "mlp.py")
        for name in files:
            shutil.copyfile(SERVERS / name, code / name)
        return code

    def base_env(self, load_log: Path) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("MODELFLEET_",
                                                                         "VIRTUAL_ENV"))}
        env.update({"BENCH_LOAD_LOG": str(load_log), "PYTHONUNBUFFERED": "1",
                    "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
                    "MKL_NUM_THREADS": "1"})
        return env

    # -- peers ------------------------------------------------------------------------------

    def start_plain(self) -> Running:
        venv = self.venvs["plain"]
        code = self.code_dir("plain", ["plain_app.py"])
        port = procs.free_port()
        load_log = self.run_dir / "plain" / "loads.log"
        env = {**self.base_env(load_log), "BENCH_CATALOG": str(self.catalog.root)}
        # The venv's console scripts run by its python, not by their shebang: a venv built
        # elsewhere (--venvs) still works.
        argv = [str(venv / "bin" / "python"), str(venv / "bin" / "uvicorn"), "plain_app:app",
                "--app-dir", str(code), "--host", "127.0.0.1", "--port", str(port),
                "--workers", str(WORKERS), "--no-access-log", "--log-level", "warning"]
        server = procs.Server("plain", argv, env, code, self.run_dir / "plain" / "server.log")
        base = f"http://127.0.0.1:{port}"
        run = Running([server], base, "plain", load_log,
                      settings={"workers": WORKERS, "models_resident": len(self.models)})
        expected = WORKERS * len(self.models)
        self.current = run  # stopped by run_system even if it never gets ready
        run.settings["startup_s"] = procs.wait_ready(
            [server], [f"{base}/health"], self.args.start_timeout_s,
            probe=lambda: _lines(load_log) >= expected and probe("plain", base, self.hot)())
        return run

    def start_mlserver(self) -> Running:
        venv = self.venvs["mlserver"]
        code = self.code_dir("mlserver", ["mlserver_mlp.py"])
        folder = self.run_dir / "mlserver" / "models"
        folder.mkdir(parents=True, exist_ok=True)
        http_port, grpc_port, metrics_port = (procs.free_port() for _ in range(3))
        settings = {"parallel_workers": WORKERS, "http_port": http_port,
                    "grpc_port": grpc_port, "metrics_port": metrics_port,
                    "host": "127.0.0.1", "load_models_at_startup": True, "debug": False,
                    "model_repository_root": str(folder)}
        (folder / "settings.json").write_text(json.dumps(settings, indent=1))
        for name in self.models:
            (folder / name).mkdir(exist_ok=True)
            (folder / name / "model-settings.json").write_text(json.dumps({
                "name": name, "implementation": "mlserver_mlp.MLPRuntime",
                "parameters": {"uri": str(self.catalog.artifact(name))}}))
        load_log = self.run_dir / "mlserver" / "loads.log"
        env = {**self.base_env(load_log), "PYTHONPATH": str(code)}
        argv = [str(venv / "bin" / "python"), str(venv / "bin" / "mlserver"), "start",
                str(folder)]
        server = procs.Server("mlserver", argv, env, code,
                              self.run_dir / "mlserver" / "server.log")
        base = f"http://127.0.0.1:{http_port}"
        run = Running([server], base, "mlserver", load_log, settings={
            "parallel_workers": WORKERS, "models_loaded": len(self.models), "debug": False})
        self.current = run  # stopped by run_system even if it never gets ready
        run.settings["startup_s"] = procs.wait_ready(
            [server], [f"{base}/v2/health/ready"], self.args.start_timeout_s,
            probe=probe("mlserver", base, self.hot))
        return run

    def start_ray(self) -> Running:
        venv = self.venvs["ray"]
        code = self.code_dir("ray", ["ray_app.py"])
        port = procs.free_port()
        load_log = self.run_dir / "ray" / "loads.log"
        temp = Path(f"/tmp/bench-ray-{os.getpid()}")
        env = {**self.base_env(load_log), "PYTHONPATH": str(code),
               "RAY_USAGE_STATS_ENABLED": "0", "RAY_DEDUP_LOGS": "0"}
        cpus = os.cpu_count() or 2
        argv = [str(venv / "bin" / "python"), str(code / "ray_app.py"), "--port", str(port),
                "--catalog", str(self.catalog.root), "--replicas", str(WORKERS),
                "--models-per-replica", str(per_replica(len(self.models))),
                "--num-cpus", str(cpus),
                "--cpus-per-replica", str(cpus / WORKERS), "--temp-dir", str(temp)]
        server = procs.Server("ray", argv, env, code, self.run_dir / "ray" / "server.log")
        base = f"http://127.0.0.1:{port}"
        run = Running([server], base, "ray", load_log, settings={
            "replicas": WORKERS, "max_num_models_per_replica": per_replica(len(self.models)),
            "num_cpus": cpus,
            "cpus_per_replica": cpus / WORKERS, "max_ongoing_requests": "default (5)",
            "access_log": False})
        run.cleanup.append(lambda: shutil.rmtree(temp, ignore_errors=True))
        self.current = run  # stopped by run_system even if it never gets ready
        run.settings["startup_s"] = procs.wait_ready(
            [server], [f"{base}/-/healthz"], self.args.start_timeout_s,
            probe=probe("ray", base, self.hot))
        return run

    # -- modelfleet -------------------------------------------------------------------------

    def modelfleet_src_env(self, load_log: Path) -> dict[str, str]:
        """The base environment with this checkout's src/ first on the path: the code
        measured is the checkout's, whichever venv (--mf-venv) runs it."""
        env = self.base_env(load_log)
        env["PYTHONPATH"] = os.pathsep.join(
            [str(ROOT / "src"), *filter(None, [env.get("PYTHONPATH")])])
        return env

    def modelfleet_env(self, load_log: Path, budget: int, broker: str) -> dict[str, str]:
        env = self.modelfleet_src_env(load_log)
        env.update({
            "MODELFLEET_BROKER": broker,
            "MODELFLEET_LOG_LEVEL": "warning",
            "MODELFLEET_WORKER__SHARED_RUNTIMES": str(WORKERS),
            "MODELFLEET_RUNTIME__DEVICE_BUDGET_BYTES": str(budget),
            "MODELFLEET_RUNTIME__HOST_BUDGET_BYTES": str(self.args.mf_host_budget_bytes),
            # The peers run without API keys: compare like with like (issue 14 puts auth on
            # by default for `gateway`).
            "MODELFLEET_TENANCY__AUTH": "off",
        })
        env.update(self.args.mf_env)  # --mf-env: recorded in the row's settings
        return env

    def mf_settings(self, budget: int) -> dict[str, Any]:
        return {"shared_runtimes": WORKERS, "device_budget_bytes_per_runtime": budget,
                "device_budget_fraction_of_catalog": round(budget / self.total_bytes, 3),
                "host_budget_bytes_per_runtime": self.args.mf_host_budget_bytes,
                "batching": {"max_batch_size": 16, "max_delay_ms": 0}, "permits": 16,
                **({"extra_env": dict(self.args.mf_env)} if self.args.mf_env else {})}

    def start_modelfleet(self, name: str, budget: int, repo: Path | None = None) -> Running:
        port = procs.free_port()
        load_log = self.run_dir / name / "loads.log"
        env = self.modelfleet_env(load_log, budget, "memory")
        repo = repo or self.repo
        argv = [str(self.args.mf_venv / "bin" / "modelfleet"), "serve", "--repo", str(repo),
                "--broker", "memory", "--host", "127.0.0.1", "--port", str(port),
                "--runtimes", str(WORKERS)]
        server = procs.Server(name, argv, env, ROOT, self.run_dir / name / "server.log")
        base = f"http://127.0.0.1:{port}"
        run = Running([server], base, "modelfleet", load_log, [f"{base}/metrics"],
                      settings=self.mf_settings(budget))
        self.current = run  # stopped by run_system even if it never gets ready
        run.settings["startup_s"] = procs.wait_ready(
            [server], [f"{base}/readyz"], self.args.start_timeout_s,
            probe=probe("modelfleet", base, self.hot))
        return run

    def mapped_unavailable(self) -> str | None:
        """Why the mapped-weights row cannot run on this build (None: it can)."""
        code = (f"import modelfleet, sys; sys.exit(0 if hasattr(modelfleet.Context, "
                f"{cat.MAPPED_API!r}) else 3)")
        done = subprocess.run([str(self.args.mf_venv / "bin" / "python"), "-c", code],
                              env=self.modelfleet_src_env(self.run_dir / "probe.log"),
                              capture_output=True, text=True, check=False)
        if done.returncode == 0:
            return None
        if done.returncode == 3:
            return (f"not available: this build's model API has no Context.{cat.MAPPED_API} "
                    "(the mapped-array API of issue 20 is not on this branch yet)")
        return f"not available: importing modelfleet failed: {done.stderr[-500:]}"

    def start_modelfleet_mapped(self) -> Running:
        """modelfleet serve, 16 % budget, with handlers that map their weights (labelled)."""
        cat.write_npy_arrays(self.catalog)
        repo = cat.write_modelfleet_repo(self.catalog, self.run_dir / "repo-mapped",
                                         handler="mapped")
        run = self.start_modelfleet("modelfleet-mapped", self.budget, repo)
        run.settings["handler"] = f"mapped (ctx.{cat.MAPPED_API}, .npy arrays)"
        return run

    def start_modelfleet_amqp(self, budget: int) -> Running:
        name = "modelfleet-amqp"
        port, probe_port = procs.free_port(), procs.free_port()
        load_log = self.run_dir / name / "loads.log"
        prefix = f"bench-{self.tag}."
        names = {"MODELFLEET_BROKER__QUEUE_PREFIX": f"{prefix}model.",
                 "MODELFLEET_BROKER__EVENTS_EXCHANGE": f"{prefix}events",
                 "MODELFLEET_BROKER__DEAD_LETTER_QUEUE": f"{prefix}dead-letters"}
        amqp, broker_settings = self.args.amqp, {"broker": "rabbitmq"}
        node: RabbitNode | None = None
        if self.args.private_rabbit_on:
            node = start_private_rabbit(self.run_dir / name / "rabbitmq")
            self.broker_pids = [node.pid] if node.pid else []
            amqp = node.url
            broker_settings.update({"private_node": node.node_name, "amqp_port": node.port,
                                    "node_startup_s": round(node.startup_s or 0, 1),
                                    "node_fd_limit": node_fd_limit(node)})
        else:
            broker_settings["amqp"] = amqp
        env = {**self.modelfleet_env(load_log, budget, amqp), **names}
        mf = str(self.args.mf_venv / "bin" / "modelfleet")
        run = Running([], f"http://127.0.0.1:{port}", "modelfleet", load_log,
                      [f"http://127.0.0.1:{port}/metrics",
                       f"http://127.0.0.1:{probe_port}/metrics"],
                      settings={**self.mf_settings(budget), **broker_settings,
                                "names": names})
        if node is not None:
            run.cleanup.append(lambda: self.stop_private_rabbit(node))
        else:
            run.cleanup.append(lambda: self.delete_amqp(
                queues=[f"{prefix}model.{m}" for m in self.models] + [f"{prefix}dead-letters"],
                exchanges=[f"{prefix}events"]))
        run.servers.append(procs.Server(
            "modelfleet-gateway", [mf, "gateway", "--repo", str(self.repo), "--broker",
                                   amqp, "--host", "127.0.0.1", "--port", str(port)],
            env, ROOT, self.run_dir / name / "gateway.log"))
        run.servers.append(procs.Server(
            "modelfleet-worker", [mf, "worker", "--repo", str(self.repo), "--broker",
                                  amqp, "--runtimes", str(WORKERS),
                                  "--probe-host", "127.0.0.1", "--probe-port", str(probe_port)],
            env, ROOT, self.run_dir / name / "worker.log"))
        self.current = run  # stopped by run_system even if it never gets ready
        run.settings["startup_s"] = procs.wait_ready(
            run.servers, [f"{run.base}/readyz", f"http://127.0.0.1:{probe_port}/readyz"],
            self.args.start_timeout_s, probe=probe("modelfleet", run.base, self.hot))
        return run

    def stop_private_rabbit(self, node: RabbitNode) -> None:
        stop_private_rabbit(node)
        self.broker_pids = []

    def delete_amqp(self, queues: list[str], exchanges: list[str]) -> None:
        import aio_pika

        async def delete() -> None:
            connection = await aio_pika.connect(self.args.amqp, timeout=10)
            try:
                for queue in queues:
                    with contextlib.suppress(Exception):
                        channel = await connection.channel()
                        await channel.queue_delete(queue)
                        await channel.close()
                for exchange in exchanges:
                    with contextlib.suppress(Exception):
                        channel = await connection.channel()
                        await channel.exchange_delete(exchange)
                        await channel.close()
            finally:
                await connection.close()

        try:
            asyncio.run(asyncio.wait_for(delete(), 60))
        except Exception as exc:
            log(f"could not delete the run's RabbitMQ queues: {exc!r}")

    def start(self, system: str) -> Running:
        if system == "plain":
            return self.start_plain()
        if system == "mlserver":
            return self.start_mlserver()
        if system == "ray":
            return self.start_ray()
        if system == "modelfleet":
            return self.start_modelfleet(system, self.budget)
        if system == "modelfleet-fits":
            return self.start_modelfleet(system, int(self.total_bytes * FITS_FACTOR))
        if system == "modelfleet-amqp":
            return self.start_modelfleet_amqp(self.budget)
        if system == "modelfleet-mapped":
            return self.start_modelfleet_mapped()
        raise ValueError(system)

    # -- load -------------------------------------------------------------------------------

    def workload_config(self, workload: str, run: Running) -> dict[str, Any]:
        a = self.args
        common = {"protocol": run.protocol, "base": run.base, "models": self.models,
                  "timeout_s": a.client_timeout_s, "seed": a.seed,
                  "load_log": str(run.load_log), "metrics_urls": run.metrics_urls}
        if workload == "zipf-32":
            return {**common, "clients": 32, "zipf_s": 1.0, "warmup_s": a.warmup_s,
                    "measure_s": a.measure_s}
        if workload == "warm-c1":
            return {**common, "clients": 1, "model": self.hot, "warmup_s": a.warm_warmup_s,
                    "measure_s": a.c1_s}
        if workload == "warm-c32":
            return {**common, "clients": 32, "model": self.hot,
                    "warmup_s": a.warm_warmup_s, "measure_s": a.c32_s}
        raise ValueError(workload)

    def loadgen(self, mode: str, cfg: dict[str, Any], limit_s: float) -> dict[str, Any]:
        python = self.venvs["loadgen"] / "bin" / "python"
        cfg_path = self.run_dir / f"loadgen-{uuid.uuid4().hex[:8]}.json"
        cfg_path.write_text(json.dumps(cfg))
        proc = subprocess.Popen([str(python), str(HERE / "loadgen.py"), mode, f"@{cfg_path}"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                cwd=HERE, start_new_session=True)
        try:
            out, err = proc.communicate(timeout=limit_s)
        except subprocess.TimeoutExpired:
            out, err = "", "load generator ran past its limit"
        finally:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(5)
        if proc.returncode != 0 or not out.strip():
            raise RuntimeError(f"load generator failed ({proc.returncode}): {err[-2000:]}")
        return dict(json.loads(out.strip().splitlines()[-1]))

    def run_system(self, system: str) -> dict[str, Any]:
        if system == "amqp-rtt":
            return self.run_amqp_rtt()
        result: dict[str, Any] = {"system": system, "workloads": {}}
        self.systems.append(result)  # filled in place: an interrupted system keeps its part
        if system == "modelfleet-mapped":
            why = self.mapped_unavailable()
            if why is not None:
                log(f"{system}: {why}")
                result.update({"error": why, "not_available": True})
                result["summary"] = summary_row(system, result)
                return result
        sampler: procs.RssSampler | None = None
        broker: procs.RssSampler | None = None
        started = time.monotonic()
        self.current = None
        try:
            log(f"{system}: starting")
            run = self.start(system)
            sampler = procs.RssSampler(run.servers).__enter__()
            if self.broker_pids:  # a private RabbitMQ node: its memory apart, not counted
                broker = procs.RssSampler([], extra_pids=lambda: self.broker_pids).__enter__()
            result["settings"] = run.settings
            result["startup_s"] = round(run.settings.pop("startup_s"), 2)
            log(f"{system}: ready in {result['startup_s']:.1f}s")
            for workload in self.args.workloads:
                cfg = self.workload_config(workload, run)
                limit = cfg["warmup_s"] + cfg["measure_s"] + self.args.client_timeout_s + 60
                log(f"{system}: {workload} ({cfg['clients']} client(s), "
                    f"{cfg['warmup_s']:g}+{cfg['measure_s']:g} s)")
                try:
                    out = self.loadgen("http", cfg, limit)
                except Exception as exc:
                    result["workloads"][workload] = {"error": str(exc)}
                    log(f"{system}: {workload} failed: {exc}")
                    continue
                if run.metrics_urls:
                    out["metrics_delta"] = stats.counter_delta(
                        out.pop("metrics_start") or {}, out.pop("metrics_end") or {})
                out.update(self.window_costs(out, sampler, run.load_log,
                                             optimum_for=workload == "zipf-32"))
                if broker is not None:
                    t0, t1 = out["window_start_unix"], out["window_end_unix"]
                    out["broker_rss"] = broker.rss_summary(t0, t1)
                    broker.sample()
                    broker_cpu = broker.cpu_between(t0, t1)
                    done = out.get("completed_ok") or 0
                    out["broker_cpu_ms_per_request"] = None if broker_cpu is None or not done \
                        else round(broker_cpu * 1000 / done, 2)
                result["workloads"][workload] = out
                cpu = out.get("cpu_ms_per_request")
                log(f"{system}: {workload}: {out['req_per_s']} req/s, p50 {out['p50_ms']} ms, "
                    f"p99 {out['p99_ms']} ms, errors {out['errors']}, "
                    f"timeouts {out['timeouts']}, CPU/req "
                    f"{'-' if cpu is None else f'{cpu:.1f}'} ms")
            if run.metrics_urls:
                result["metrics_final"] = self.scrape(run.metrics_urls)
            result["load_log_lines_total"] = _lines(run.load_log)
        except procs.StartFailed as exc:
            result["error"] = f"start failed: {exc}"
            log(f"{system}: {result['error'][:3000]}")
        except Exception as exc:
            result["error"] = f"{type(exc).__name__}: {exc}"
            log(f"{system}: failed: {traceback.format_exc()}")
        finally:
            for s in (sampler, broker):
                if s is not None:
                    s.__exit__(None, None, None)
            if sampler is not None:
                result["peak_rss_bytes"] = sampler.peak_bytes
                result["peak_rss_processes"] = sampler.peak_processes
                result["rss"] = sampler.rss_summary()
                result["pss"] = sampler.pss_summary()
                # (unix time, RSS bytes, cumulative CPU s, processes), every 0.5 s
                result["rss_series"] = [(round(t, 2), b, round(c, 2), n)
                                        for t, b, c, n in sampler.series]
            if broker is not None:
                result["broker_rss"] = broker.rss_summary()
            run_ = self.current
            if run_ is not None:  # started, ready or not
                codes = {s.name: s.stop() for s in run_.servers}
                result["exit_codes"] = codes
                for step in run_.cleanup:
                    step()
            self.current = None
            result["wall_s"] = round(time.monotonic() - started, 1)
            result["summary"] = summary_row(system, result)
        return result

    def window_costs(self, out: dict[str, Any], sampler: procs.RssSampler, load_log: Path,
                     optimum_for: bool) -> dict[str, Any]:
        """What the measured window cost: the process tree's CPU per answer, its RSS, the
        loads and bytes of the load log in the window, and (zipf-32) the static optimum."""
        t0, t1 = out["window_start_unix"], out["window_end_unix"]
        sampler.sample()  # one sample after the window's end, whatever the sampler's phase
        costs: dict[str, Any] = {}
        cpu = sampler.cpu_between(t0, t1)
        costs["cpu_s_window"] = None if cpu is None else round(cpu, 3)
        done = out.get("completed_ok") or 0
        costs["cpu_ms_per_request"] = None if cpu is None or not done else \
            round(cpu * 1000 / done, 2)
        costs["rss_window"] = sampler.rss_summary(t0, t1)
        loads, loaded = load_log_window(load_log, t0, t1)
        requests = out.get("requests_started") or 0
        costs["load_log_window"] = {"loads": loads, "bytes": loaded}
        costs["bytes_loaded_per_request"] = round(loaded / requests, 1) if requests else None
        costs.update(metric_load_bytes(out.get("metrics_delta"), loaded, requests))
        if optimum_for and out.get("requests_per_model"):
            warm = out.get("warmup_requests_per_model") or {}
            pooled = optimum.static_optimum(out["requests_per_model"], self.sizes,
                                            self.pooled_budget, warm=warm)
            bare = optimum.static_optimum(out["requests_per_model"], self.sizes,
                                          self.pooled_budget, reserve_bytes=0, warm=warm)
            costs["static_optimum"] = {"pooled_budget_one_reserve": pooled.as_dict(),
                                       "pooled_budget_no_reserve": bare.as_dict()}
        return costs

    def run_amqp_rtt(self) -> dict[str, Any]:
        a = self.args
        cfg = {"url": a.amqp, "warmup_s": a.warm_warmup_s, "measure_s": a.c1_s,
               "tag": self.tag}
        result: dict[str, Any] = {"system": "amqp-rtt", "summary": {"system": "amqp-rtt"}}
        self.systems.append(result)
        log("amqp-rtt: aio-pika round trip, c1")
        try:
            out = self.loadgen("amqp-rtt", cfg, cfg["warmup_s"] + cfg["measure_s"] + 60)
        except Exception as exc:
            log(f"amqp-rtt failed: {exc}")
            result["error"] = result["summary"]["error"] = str(exc)
            return result
        finally:
            self.delete_amqp([f"bench-rtt-{self.tag}.requests"], [])
        log(f"amqp-rtt: p50 {out['p50_ms']} ms, p99 {out['p99_ms']} ms")
        result["workloads"] = {"warm-c1": out}
        result["summary"].update({"c1_p50_ms": out["p50_ms"], "c1_p99_ms": out["p99_ms"]})
        return result

    def scrape(self, urls: list[str]) -> dict[str, float]:
        texts = []
        for url in urls:
            try:
                texts.append(httpx.get(url, timeout=10).text)
            except httpx.HTTPError as exc:
                texts.append(f"# {url}: {exc!r}")
        return stats.fold_prometheus("\n".join(texts))


LOAD_BYTES_METRIC = "modelfleet_model_load_bytes_total"
STORAGE_SOURCES = ("repository", "disk")  # loads that read storage ('host': a promotion)


def metric_load_bytes(delta: dict[str, float] | None, log_bytes: int,
                      requests: int) -> dict[str, Any]:
    """Bytes loaded in the window from modelfleet's own counter (by source), where the
    build exports it, beside the load log's figure as a cross-check (the counter measures
    a package at its load; the log, the four arrays the shared code read)."""
    if delta is None:
        return {}
    by_source = stats.metric_by_label(delta, LOAD_BYTES_METRIC, "source")
    if not by_source:
        return {}
    storage = sum(by_source.get(s, 0.0) for s in STORAGE_SOURCES)
    return {"metric_load_bytes_window": {"by_source": by_source, "storage_bytes": storage},
            "bytes_loaded_per_request_metric": round(storage / requests, 1) if requests
            else None,
            "metric_over_load_log": round(storage / log_bytes, 3) if log_bytes else None}


def start_private_rabbit(folder: Path) -> RabbitNode:
    """A RabbitMQ node of the run's own (``modelfleet.devtools.rabbit_node``): own name,
    free ports, its config, data and logs under ``folder``, ``ulimit -n 20000``."""
    folder.mkdir(parents=True, exist_ok=True)
    node = RabbitNode(folder, fd_limit=RABBIT_FD_LIMIT)
    log(f"starting a private RabbitMQ node {node.node_name} (ulimit -n {RABBIT_FD_LIMIT})")
    try:
        node.start(timeout_s=120)  # stops what it started when it fails
    except BaseException:
        shutil.rmtree(folder / "mnesia", ignore_errors=True)  # the logs stay
        raise
    log(f"private RabbitMQ node {node.node_name} on port {node.port}, up in "
        f"{node.startup_s or 0:.1f}s")
    return node


def node_fd_limit(node: RabbitNode) -> int | None:
    """The node's own limit on open files, as it reports it (``rabbitmqctl status``)."""
    try:
        return node.resources().file_descriptor_limit
    except Exception as exc:
        log(f"could not read the private node's descriptor limit: {exc!r}")
        return None


def stop_private_rabbit(node: RabbitNode) -> None:
    """Stop the node (its whole process group) and drop its data; its logs stay in the
    run folder."""
    log(f"stopping the private RabbitMQ node {node.node_name}")
    try:
        node.stop()
    except Exception as exc:
        log(f"could not stop the private RabbitMQ node {node.node_name}: {exc!r}")
    shutil.rmtree(node.base_dir / "mnesia", ignore_errors=True)


def load_log_window(path: Path, t0: float, t1: float) -> tuple[int, int]:
    """Loads and bytes of the load log's lines stamped within [t0, t1) (unix seconds)."""
    loads = loaded = 0
    try:
        with path.open() as f:
            for line in f:
                parts = line.split()
                try:
                    stamp, nbytes = float(parts[0]), int(parts[3])
                except (IndexError, ValueError):
                    continue
                if t0 <= stamp < t1:
                    loads += 1
                    loaded += nbytes
    except FileNotFoundError:
        pass
    return loads, loaded


def _lines(path: Path) -> int:
    try:
        with path.open("rb") as f:
            return sum(1 for _ in f)
    except FileNotFoundError:
        return 0


MF_INTERESTING = ("modelfleet_worker_idle_permit_seconds_while_backlog_total",
                  "modelfleet_worker_permits_cap", "modelfleet_worker_permits_in_use",
                  "modelfleet_model_loads_per_minute", "modelfleet_runtimes_ready",
                  "modelfleet_resident_models", "modelfleet_resident_bytes")


def summary_row(system: str, result: dict[str, Any]) -> dict[str, Any]:
    """The figures of one system that the table shows (None where missing)."""
    w = result.get("workloads", {})
    zipf, c1, c32 = w.get("zipf-32", {}), w.get("warm-c1", {}), w.get("warm-c32", {})
    row: dict[str, Any] = {
        "system": system,
        "zipf_rps": zipf.get("req_per_s"), "zipf_p50_ms": zipf.get("p50_ms"),
        "zipf_p90_ms": zipf.get("p90_ms"), "zipf_p99_ms": zipf.get("p99_ms"),
        "zipf_errors": zipf.get("errors"), "zipf_timeouts": zipf.get("timeouts"),
        "c1_p50_ms": c1.get("p50_ms"), "c32_rps": c32.get("req_per_s"),
        "c32_p99_ms": c32.get("p99_ms"),
        "rss_mb": round(result["peak_rss_bytes"] / 2**20) if result.get(
            "peak_rss_bytes") else None,
        "error": result.get("error"),
        "not_available": bool(result.get("not_available")),
        "startup_s": result.get("startup_s"),
        "zipf_cpu_ms_per_request": zipf.get("cpu_ms_per_request"),
        "zipf_bytes_per_request": zipf.get("bytes_loaded_per_request"),
        "zipf_bytes_per_request_metric": zipf.get("bytes_loaded_per_request_metric"),
        "zipf_loads_log": (zipf.get("load_log_window") or {}).get("loads"),
    }
    for kind in ("rss", "pss"):
        summary = result.get(kind) or {}
        for key in ("start", "max", "end"):
            value = summary.get(f"{key}_bytes")
            row[f"{kind}_{key}_mb"] = None if value is None else round(value / 2**20)
    opt = (zipf.get("static_optimum") or {}).get("pooled_budget_one_reserve") or {}
    row["zipf_optimum_bytes_per_request"] = opt.get("bytes_per_request")
    row["zipf_optimum_bound_bytes_per_request"] = opt.get("bound_bytes_per_request")
    bare = (zipf.get("static_optimum") or {}).get("pooled_budget_no_reserve") or {}
    row["zipf_optimum_no_reserve_bytes_per_request"] = bare.get("bytes_per_request")
    row["zipf_broker_cpu_ms_per_request"] = zipf.get("broker_cpu_ms_per_request")
    row["zipf_phases"] = zipf.get("phases")  # modelfleet's Server-Timing: all, and the tail
    delta = zipf.get("metrics_delta")
    if delta is not None:
        loads = stats.metric_total(delta, "modelfleet_model_loads_total")
        row["zipf_loads"] = None if loads is None else int(loads)
        row["zipf_503"] = int(stats.metric_total(
            delta, "modelfleet_gateway_requests_total", status="503") or 0)
        idle = stats.metric_total(
            delta, "modelfleet_worker_idle_permit_seconds_while_backlog_total")
        row["zipf_idle_permit_s_while_backlog"] = idle
    else:
        row["zipf_loads"] = zipf.get("loads_in_window_log")
    return row


# -- main -----------------------------------------------------------------------------------

def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n".join(__doc__.splitlines()[2:]))
    p.add_argument("--only", default="", help=f"comma-separated subset of {','.join(SYSTEMS)}")
    p.add_argument("--workloads", default="",
                   help=f"comma-separated subset of {','.join(WORKLOADS)} (default: all; "
                        "the scale variant: zipf-32)")
    p.add_argument("--models", type=int, default=cat.N_MODELS,
                   help="models in the catalog (default 50; 5000 is the scale variant)")
    p.add_argument("--scale", action="store_true",
                   help=f"the scale variant: --models {cat.SCALE_MODELS} (sizes small)")
    p.add_argument("--sizes", choices=sorted(cat.SIZE_PRESETS), default=None,
                   help="artifact sizes: large = 1-40 MiB (default at 50 models), small = "
                        "20 KB-1 MB (default otherwise)")
    p.add_argument("--mapped", action="store_true",
                   help="add the labelled row modelfleet-mapped (handlers map their weights "
                        "with ctx.map_array; 'not available' where the build lacks it)")
    p.add_argument("--private-rabbit", choices=("auto", "on", "off"), default="auto",
                   help="modelfleet-amqp on a RabbitMQ node of its own (ulimit -n 20000, free "
                        f"ports, stopped after); auto: from {PRIVATE_RABBIT_FROM} models on")
    p.add_argument("--quick", action="store_true",
                   help="a ~5 s smoke run of every workload (figures mean nothing)")
    p.add_argument("--measure-s", type=float, default=45.0, help="zipf-32 measured seconds")
    p.add_argument("--warmup-s", type=float, default=5.0, help="zipf-32 warm-up seconds")
    p.add_argument("--c1-s", type=float, default=5.0, help="warm-c1 measured seconds")
    p.add_argument("--c32-s", type=float, default=10.0, help="warm-c32 measured seconds")
    p.add_argument("--warm-warmup-s", type=float, default=2.0,
                   help="warm-up of warm-c1, warm-c32 and amqp-rtt")
    p.add_argument("--client-timeout-s", type=float, default=30.0)
    p.add_argument("--start-timeout-s", type=float, default=None,
                   help="per system (default 240 s; 900 s from 1,000 models on)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--mf-host-budget-bytes", type=int, default=0,
                   help="modelfleet host-tier budget per runtime (default 0: on a CPU box "
                        "the host tier is the same RAM, so it would hold the whole catalog)")
    p.add_argument("--amqp", default=os.environ.get("MODELFLEET_TEST_AMQP",
                                                    "amqp://guest:guest@127.0.0.1:5672/"))
    p.add_argument("--python", default=shutil.which("python3") or sys.executable,
                   help="interpreter the peers' venvs are made with")
    p.add_argument("--skip-build", action="store_true", help="reuse the venvs; build none")
    p.add_argument("--venvs", type=Path,
                   default=Path(os.environ.get("BENCH_PEERS_VENVS") or VENVS),
                   help="folder of the peers' venvs (default bench/peers/.venvs, or "
                        "$BENCH_PEERS_VENVS): reuse ones built in another checkout")
    p.add_argument("--mf-env", action="append", default=[], metavar="MODELFLEET_X=V",
                   help="an extra setting for every modelfleet process (repeatable; recorded "
                        "in the row's settings), e.g. MODELFLEET_RUNTIME__RSS_MARGIN=1")
    p.add_argument("--mf-venv", type=Path, default=MODELFLEET_VENV,
                   help="the venv whose `modelfleet` runs this checkout's src/ (default the "
                        "checkout's .venv; a git worktree without one: the main checkout's)")
    p.add_argument("--no-save", action="store_true", help="write no results file")
    p.add_argument("--results", type=Path, default=None, metavar="PATH",
                   help="write the results JSON there instead of results/latest*.json")
    args = p.parse_args(argv)
    if args.scale:
        args.models = cat.SCALE_MODELS
    pairs = [item.partition("=") for item in args.mf_env]
    if any(not key.startswith("MODELFLEET_") or not eq for key, eq, _ in pairs):
        p.error("--mf-env takes MODELFLEET_NAME=VALUE")
    args.mf_env = {key: value for key, _, value in pairs}
    if args.models < 1:
        p.error("--models must be >= 1")
    if args.sizes is None:
        args.sizes = "large" if args.models == cat.N_MODELS else "small"
    # The scale variant's shape (zipf-32, the five systems) for any other catalog, 50 small
    # models included (the point issue 23 compares CPU per request with).
    scale = (args.models, args.sizes) != (cat.N_MODELS, "large")
    if args.start_timeout_s is None:
        args.start_timeout_s = 900.0 if args.models >= 1000 else 240.0
    args.private_rabbit_on = args.private_rabbit == "on" or (
        args.private_rabbit == "auto" and args.models >= PRIVATE_RABBIT_FROM)
    if not args.workloads:
        args.workloads = "zipf-32" if scale else ",".join(WORKLOADS)
    if args.quick:
        args.warmup_s, args.measure_s, args.c1_s, args.c32_s, args.warm_warmup_s = \
            1.0, 5.0, 2.0, 3.0, 1.0
    default = list(SCALE_SYSTEMS if scale else DEFAULT_SYSTEMS)
    if args.mapped:
        default.insert(default.index("modelfleet") + 1, "modelfleet-mapped")
    args.systems = [s for s in (args.only.split(",") if args.only else default) if s]
    unknown = [s for s in args.systems if s not in SYSTEMS]
    args.workloads = [w for w in args.workloads.split(",") if w]
    if unknown or any(w not in WORKLOADS for w in args.workloads):
        p.error(f"unknown system or workload: {unknown or args.workloads}")
    return args


def machine() -> dict[str, Any]:
    return {"nproc": os.cpu_count(), "ram_bytes": psutil.virtual_memory().total,
            "ram_gib": round(psutil.virtual_memory().total / 2**30, 1),
            "platform": platform.platform(), "python": platform.python_version(),
            "loadavg_at_start": [round(x, 2) for x in os.getloadavg()]}


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    def raise_interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt
    previous = signal.signal(signal.SIGTERM, raise_interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.time()
    with sigterm_as_interrupt():
        bench_venvs: dict[str, Path] = {}
        needed = {"loadgen"} | {VENV_OF[s] for s in args.systems if s in VENV_OF}
        for name in sorted(needed):
            bench_venvs[name] = ensure_venv(name, args.python, args.skip_build, args.venvs)
        bench = Bench(args)
        bench.venvs = bench_venvs
        log(f"catalog: {len(bench.models)} models, {bench.total_bytes / 2**20:.1f} MiB in all; "
            f"run folder {bench.run_dir.relative_to(ROOT)}")
        versions = {name: versions_in(venv / "bin" / "python", PEER_PACKAGES[name])
                    for name, venv in bench_venvs.items()}
        versions["modelfleet"] = {**versions_in(args.mf_venv / "bin" / "python",
                                                PEER_PACKAGES["modelfleet"]), **git_describe()}
        interrupted = False
        try:
            for system in args.systems:
                bench.run_system(system)
        except KeyboardInterrupt:
            interrupted = True
            log("interrupted: servers stopped; writing what was measured")
    sizes = bench.sizes
    results = {
        "command": [sys.executable, *sys.argv] if argv is None else ["run.py", *argv],
        "started": dt.datetime.fromtimestamp(started).isoformat(timespec="seconds"),
        "wall_s": round(time.time() - started, 1),
        "interrupted": interrupted,
        "quick": args.quick,
        "machine": machine(),
        "versions": versions,
        "catalog": {"models": len(sizes), "total_bytes": bench.total_bytes,
                    "min_bytes": min(sizes.values()), "max_bytes": max(sizes.values()),
                    "seed": cat.SEED, "size_preset": args.sizes,
                    "budget_bytes_per_runtime": bench.budget,
                    "pooled_budget_bytes": bench.pooled_budget,
                    "models_per_ray_replica": per_replica(len(sizes)), "sizes": sizes},
        "durations": {"zipf_warmup_s": args.warmup_s, "zipf_measure_s": args.measure_s,
                      "c1_s": args.c1_s, "c32_s": args.c32_s,
                      "warm_warmup_s": args.warm_warmup_s,
                      "client_timeout_s": args.client_timeout_s},
        "systems": bench.systems,
    }
    table = render(results)
    results["table_markdown"] = table
    print(table)
    if args.results is not None:
        args.results.parent.mkdir(parents=True, exist_ok=True)
        args.results.write_text(json.dumps(results, indent=1) + "\n")
        log(f"wrote {args.results}")
    elif not args.no_save:
        RESULTS.mkdir(exist_ok=True)
        variant = "" if args.models == cat.N_MODELS and args.sizes == "large" else \
            f"-{args.models}-{args.sizes}"
        suffix = variant + ("-quick" if args.quick else "")
        stamped = RESULTS / f"{bench.stamp}{suffix}.json"
        stamped.write_text(json.dumps(results, indent=1) + "\n")
        latest = RESULTS / f"latest{suffix}.json"
        shutil.copyfile(stamped, latest)
        log(f"wrote {latest.relative_to(ROOT)} and {stamped.relative_to(ROOT)}")
    return 130 if interrupted else 0


if __name__ == "__main__":
    sys.exit(main())
