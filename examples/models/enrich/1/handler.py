"""Enrichment: look up an entity's features over HTTP in ``preprocess``, score them in ``predict``.

Request ``{"entity": "user-42"}``; answer ``{"entity": ..., "features": {...},
"score": 0.37}``. ``load`` starts the package's own feature service (see
``feature_service.py``: generated data, 127.0.0.1, an ephemeral port, a simulated
latency of ``MODELFLEET_EXAMPLE_ENRICH_LATENCY_MS``, default 200 ms, per lookup).

The lookup is awaited on the event loop, so while one request waits for its
features the loop runs the others' lookups: twenty concurrent requests take about
one lookup latency, not twenty. ``predict`` is a fixed logistic score (no artifact).
"""

from __future__ import annotations

import math
import os
import re
from typing import Any

import httpx
from feature_service import ENTITY_COUNT, FeatureService, generate_features

from modelfleet import Context, InvalidInput, Model, Request
from modelfleet.errors import ModelFailed

LATENCY_ENV_VAR = "MODELFLEET_EXAMPLE_ENRICH_LATENCY_MS"
DEFAULT_LATENCY_MS = 200.0
LOOKUP_TIMEOUT_S = 5.0
ENTITY = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")
EXPECTED = '{"entity": "user-42"}'

# Score: a fixed logistic model of "likely to order again soon".
WEIGHTS = {"account_age_days": 0.0004, "orders_90d": 0.12, "returns_90d": -0.35,
           "avg_order_eur": 0.004}
BIAS = -1.5


def latency_s() -> float:
    raw = os.environ.get(LATENCY_ENV_VAR, "")
    try:
        ms = float(raw) if raw else DEFAULT_LATENCY_MS
    except ValueError:
        raise ValueError(f"{LATENCY_ENV_VAR}={raw!r} is not a number of milliseconds") from None
    return max(ms, 0.0) / 1000.0


def score(features: dict[str, Any]) -> float:
    z = BIAS + sum(w * float(features[name]) for name, w in WEIGHTS.items())
    return round(1.0 / (1.0 + math.exp(-z)), 6)


class Enrich(Model):
    def load(self, ctx: Context) -> None:
        self.service = FeatureService(generate_features(), latency_s())
        self.service.start()

    def unload(self) -> None:
        self.service.stop()

    async def preprocess(self, request: Request) -> tuple[str, dict[str, Any]]:
        payload = request.json()
        entity = payload.get("entity") if isinstance(payload, dict) else None
        if not isinstance(entity, str) or not ENTITY.match(entity):
            raise InvalidInput(f"expected a JSON object {EXPECTED}; got {payload!r:.100}")
        # A client per lookup keeps this coroutine free of any one event loop (tests run
        # a loop per test). verify=False skips loading a CA bundle: the service is plain
        # HTTP on loopback. trust_env=False: no proxy settings for a loopback address.
        async with httpx.AsyncClient(base_url=self.service.url, verify=False, trust_env=False,
                                     timeout=LOOKUP_TIMEOUT_S) as client:
            try:
                response = await client.get("/features", params={"entity": entity})
            except httpx.HTTPError as exc:
                raise ModelFailed(f"feature service unreachable: {exc!r}") from exc
        if response.status_code == 404:
            raise InvalidInput(
                f"unknown entity {entity!r}: known entities are user-0 .. user-{ENTITY_COUNT - 1}"
            )
        if response.status_code != 200:
            raise ModelFailed(f"feature service answered {response.status_code} for {entity!r}")
        features: dict[str, Any] = response.json()
        return entity, features

    def predict(self, batch: list[tuple[str, dict[str, Any]]]) -> list[dict[str, Any]]:
        return [{"entity": entity, "features": features, "score": score(features)}
                for entity, features in batch]

    async def postprocess(self, output: dict[str, Any], request: Request) -> dict[str, Any]:
        # The most lookups this runtime has had waiting at once: above 1 shows that a
        # request awaiting its features does not hold the process for the others.
        return {**output, "lookups_in_flight_max": self.service.max_in_flight}
