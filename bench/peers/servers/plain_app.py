"""The `plain` peer: one Starlette app holding the whole catalog, run by uvicorn.

    BENCH_CATALOG=<catalog dir> uvicorn plain_app:app --workers 2 ...

Every worker process loads all models at start-up (lifespan), then answers
``POST /v1/models/{model}/infer`` with ``{"inputs": [64 floats]}`` -> ``{"outputs": [10]}``
on its event loop. No queue, no batching, no eviction: the upper limit.
"""

from __future__ import annotations

import json
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import mlp
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

MODELS: dict[str, mlp.MLP] = {}


def load_all(root: Path) -> None:
    for folder in sorted(p for p in root.iterdir() if (p / "weights.npz").is_file()):
        MODELS[folder.name] = mlp.load(folder / "weights.npz", name=folder.name)


@asynccontextmanager
async def lifespan(app: Starlette) -> AsyncIterator[None]:
    load_all(Path(os.environ["BENCH_CATALOG"]))  # before serving: nothing else to do meanwhile
    yield
    MODELS.clear()


async def infer(request: Request) -> Response:
    model = MODELS.get(request.path_params["model"])
    if model is None:
        return JSONResponse({"error": "model not found"}, status_code=404)
    try:
        row = mlp.parse_inputs(json.loads(await request.body()))
    except ValueError as exc:
        return JSONResponse({"error": str(exc)}, status_code=422)
    return JSONResponse({"outputs": mlp.predict(model, row)[0].tolist()})


async def health(request: Request) -> Response:
    return JSONResponse({"models": len(MODELS)})


app = Starlette(routes=[Route("/v1/models/{model}/infer", infer, methods=["POST"]),
                        Route("/health", health)], lifespan=lifespan)
