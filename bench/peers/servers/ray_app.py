"""The `ray` peer: Ray Serve with model multiplexing over the catalog.

    python ray_app.py --port P --catalog DIR [--replicas 2] [--models-per-replica 8]

Starts a local Ray (CPUs as given, no dashboard, bounded object store), one deployment
with ``@serve.multiplexed(max_num_models_per_replica=8)`` and N replicas, HTTP on
127.0.0.1:P. A request is ``POST /infer`` with the header
``serve_multiplexed_model_id: model-NN`` (Serve routes it to a replica that holds the
model when it can) and body ``{"inputs": [64 floats]}``; the answer ``{"outputs": [10]}``.
Runs until SIGTERM or SIGINT, then shuts Serve and Ray down.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
from pathlib import Path

import mlp
import ray
from ray import serve
from starlette.requests import Request
from starlette.responses import JSONResponse, Response


def build(catalog: str, replicas: int, per_replica: int, cpus_per_replica: float,
          max_ongoing: int | None) -> serve.Application:
    options: dict[str, object] = {"num_replicas": replicas,
                                  "ray_actor_options": {"num_cpus": cpus_per_replica}}
    if max_ongoing:
        options["max_ongoing_requests"] = max_ongoing

    @serve.deployment(**options)
    class MLPService:
        def __init__(self) -> None:
            self.root = Path(catalog)

        @serve.multiplexed(max_num_models_per_replica=per_replica)
        async def get_model(self, model_id: str) -> mlp.MLP:
            path = self.root / model_id / "weights.npz"
            if not path.is_file():
                raise KeyError(model_id)
            return mlp.load(path, name=model_id)

        async def __call__(self, request: Request) -> Response:
            model_id = serve.get_multiplexed_model_id()
            try:
                model = await self.get_model(model_id)
            except KeyError:
                return JSONResponse({"error": f"model {model_id!r} not found"}, status_code=404)
            try:
                row = mlp.parse_inputs(json.loads(await request.body()))
            except ValueError as exc:
                return JSONResponse({"error": str(exc)}, status_code=422)
            return JSONResponse({"outputs": mlp.predict(model, row)[0].tolist()})

    return MLPService.bind()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--catalog", required=True)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--models-per-replica", type=int, default=8)
    parser.add_argument("--num-cpus", type=float, default=float(os.cpu_count() or 2))
    parser.add_argument("--cpus-per-replica", type=float, default=1.0)
    parser.add_argument("--max-ongoing-requests", type=int, default=0,
                        help="per replica; 0 keeps Serve's default")
    parser.add_argument("--object-store-bytes", type=int, default=256 * 1024 * 1024)
    parser.add_argument("--temp-dir", default="")
    args = parser.parse_args()

    stop = threading.Event()

    init: dict[str, object] = {"num_cpus": args.num_cpus, "include_dashboard": False,
                               "object_store_memory": args.object_store_bytes,
                               "log_to_driver": False}
    if args.temp_dir:
        init["_temp_dir"] = args.temp_dir
    ray.init(**init)
    # After ray.init, which installs handlers of its own: a SIGTERM stops Serve, then Ray.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        # Access logs off, as for every peer: a log line per request is not the bench.
        quiet = {"log_level": "WARNING", "enable_access_log": False}
        serve.start(http_options={"host": "127.0.0.1", "port": args.port},
                    logging_config=quiet)
        serve.run(build(args.catalog, args.replicas, args.models_per_replica,
                        args.cpus_per_replica, args.max_ongoing_requests or None),
                  name="mlp", route_prefix="/infer", logging_config=quiet)
        print("READY", flush=True)
        stop.wait()
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
