"""Text embeddings from a hashed bag of words and a random projection, its weights mapped.

Request: any UTF-8 text (``text/plain``). Answer: ``{"embedding": [64 floats],
"dim": 64, "tokens": n}``, a unit vector; texts that share words point the same way
(cosine similarity), whatever their length.

Each lower-cased word is hashed (blake2b, the same in every process) into one of
``BUCKETS`` rows of a fixed Gaussian projection matrix (Johnson-Lindenstrauss: the
angles between bags of words survive, approximately); the embedding is the sum of
those rows weighted by ``1 + log(count)``, normalised.

The projection is 16 MB of float32 in ``artifacts/projection.safetensors``, and
``load`` *maps* it (``ctx.map_tensors``) rather than reading it: a load costs no copy
and no private memory, a request touches only the rows of its words, and every
runtime that holds the model shares one copy of the pages. ``build_artifact``
writes it deterministically (seed 0) when it is missing or has another shape.
"""

from __future__ import annotations

import hashlib
import os
import re
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import save_file

from modelfleet import Context, InvalidInput, Model, Request
from modelfleet.errors import ModelLoadFailed

ARTIFACT = "artifacts/projection.safetensors"
BUCKETS = 1 << 16
DIM = 64
SEED = 0
MAX_CHARS = 100_000
WORD = re.compile(r"\w+")


def build_artifact(path: Path) -> None:
    """Write the projection atomically (temp file, then ``os.replace``): concurrent
    loads never map half a file."""
    rng = np.random.default_rng(SEED)
    projection = (rng.standard_normal((BUCKETS, DIM), dtype=np.float32)
                  / np.float32(np.sqrt(DIM)))
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        save_file({"projection": projection}, tmp, metadata={"seed": str(SEED)})
        os.chmod(tmp, 0o644)  # mkstemp makes it owner-only; a runtime may run as another user
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def map_or_build(ctx: Context) -> np.ndarray:
    """The mapped projection; built first when missing or not the expected shape."""
    try:
        projection = ctx.map_tensors(ARTIFACT).get("projection")
        if projection is not None and projection.shape == (BUCKETS, DIM) \
                and projection.dtype == np.float32:
            return projection
    except ModelLoadFailed:  # missing or damaged: rebuilding takes a fraction of a second
        pass
    build_artifact(ctx.artifact(ARTIFACT))
    return ctx.map_tensors(ARTIFACT)["projection"]


def bucket(word: str) -> int:
    return int.from_bytes(hashlib.blake2b(word.encode(), digest_size=8).digest(),
                          "little") % BUCKETS


def bag_of_words(text: str) -> tuple[np.ndarray, np.ndarray, int]:
    """(bucket indices, weights 1 + log(count), number of words) of ``text``."""
    counts: dict[int, int] = {}
    words = WORD.findall(text.lower())
    for word in words:
        index = bucket(word)
        counts[index] = counts.get(index, 0) + 1
    indices = np.fromiter(counts, dtype=np.int64, count=len(counts))
    weights = 1.0 + np.log(np.fromiter(counts.values(), dtype=np.float32, count=len(counts)))
    return indices, weights.astype(np.float32), len(words)


class TextEmbedder(Model):
    def load(self, ctx: Context) -> None:
        self.projection = map_or_build(ctx)  # a read-only view of the file's pages

    async def preprocess(self, request: Request) -> tuple[np.ndarray, np.ndarray, int]:
        text = request.text()
        if len(text) > MAX_CHARS:
            raise InvalidInput(f"text is {len(text)} characters; the limit is {MAX_CHARS}")
        bag = bag_of_words(text)
        if not bag[2]:
            raise InvalidInput("no words in the text: send the text to embed as text/plain")
        return bag

    def predict(self, batch: list[tuple[np.ndarray, np.ndarray, int]]) -> list[dict[str, Any]]:
        answers = []
        for indices, weights, words in batch:
            vector = weights @ self.projection[indices]  # touches only these rows' pages
            vector /= max(float(np.linalg.norm(vector)), 1e-12)
            answers.append({"embedding": [round(float(v), 6) for v in vector], "dim": DIM,
                            "tokens": words})
        return answers
