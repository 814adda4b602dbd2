"""Iris species from four flower measurements: the smallest useful tabular model.

Request: ``{"features": [sepal_length, sepal_width, petal_length, petal_width]}``
(centimetres). Answer: ``{"class": "setosa", "class_index": 0, "probabilities": [...]}``.
On /v2 (its tensor signature in model.toml): input ``features`` FP32 [n, 4], outputs
``probabilities`` FP32 [n, 3], ``class_index`` INT64 [n] and ``class`` BYTES [n].
A batch may mix both kinds of request: each is a block of rows.
``build_artifact`` trains a scaled logistic regression on scikit-learn's bundled
iris data (deterministic); ``load`` calls it when ``artifacts/model.joblib`` is
missing or was written by another scikit-learn version.
"""

from __future__ import annotations

import math
import os
import tempfile
import warnings
from pathlib import Path
from typing import Any

import joblib
import numpy as np
import sklearn
from sklearn.datasets import load_iris
from sklearn.linear_model import LogisticRegression
from sklearn.pipeline import Pipeline, make_pipeline
from sklearn.preprocessing import StandardScaler

from modelfleet import Context, InvalidInput, Model, Request

ARTIFACT = "artifacts/model.joblib"
ARTIFACT_FORMAT = 1
FEATURES = ("sepal_length_cm", "sepal_width_cm", "petal_length_cm", "petal_width_cm")
EXPECTED = '{"features": [sepal_length, sepal_width, petal_length, petal_width]} (numbers, cm)'


def train_classifier() -> tuple[Pipeline, list[str]]:
    iris = load_iris()
    clf = make_pipeline(StandardScaler(), LogisticRegression(C=10.0, max_iter=1000))
    return clf.fit(iris.data, iris.target), [str(n) for n in iris.target_names]


def build_artifact(path: Path) -> dict[str, Any]:
    """Train and write the artifact atomically (temp file, then ``os.replace``)."""
    clf, names = train_classifier()
    artifact = {"format": ARTIFACT_FORMAT, "sklearn_version": sklearn.__version__,
                "classifier": clf, "class_names": names}
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            joblib.dump(artifact, f)
        os.chmod(tmp, 0o644)  # mkstemp makes it owner-only; a runtime may run as another user
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return artifact


def load_or_build(path: Path) -> dict[str, Any]:
    """The artifact at ``path``; rebuilt when missing, unreadable or from another sklearn."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # an old pickle's version warning: checked below
            artifact = joblib.load(path)
        if (isinstance(artifact, dict) and artifact.get("format") == ARTIFACT_FORMAT
                and artifact.get("sklearn_version") == sklearn.__version__):
            return artifact
    except Exception:  # missing, damaged or foreign: rebuilding takes a fraction of a second
        pass
    return build_artifact(path)


def parse_features(payload: Any) -> list[float]:
    """The four measurements of a request, or ``InvalidInput`` saying what was expected."""
    if not isinstance(payload, dict) or "features" not in payload:
        raise InvalidInput(f"expected a JSON object {EXPECTED}")
    unknown = sorted(set(payload) - {"features"})
    if unknown:
        raise InvalidInput(f"unknown field(s) {unknown}; expected {EXPECTED}")
    features = payload["features"]
    if not isinstance(features, list) or len(features) != len(FEATURES):
        got = f"{len(features)} items" if isinstance(features, list) else type(features).__name__
        raise InvalidInput(
            f"'features' must be a list of 4 numbers, got {got}; expected {EXPECTED}"
        )
    values = []
    for name, value in zip(FEATURES, features, strict=True):
        # bool is an int in Python; true/false is not a measurement.
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise InvalidInput(f"'features' item {name} must be a number, got {value!r}")
        if not math.isfinite(value):
            raise InvalidInput(f"'features' item {name} must be finite, got {value!r}")
        values.append(float(value))
    return values


class IrisClassifier(Model):
    def load(self, ctx: Context) -> None:
        artifact = load_or_build(ctx.artifact(ARTIFACT))
        self.clf: Pipeline = artifact["classifier"]
        self.class_names: list[str] = artifact["class_names"]

    async def preprocess(self, request: Request) -> np.ndarray:
        """Rows of features: one row for /v1, the tensor's rows for /v2."""
        if request.tensors is not None:  # shape [n, 4] and FP32 checked against model.toml
            rows = np.asarray(request.tensors["features"], dtype=np.float64)
            if not np.isfinite(rows).all():
                raise InvalidInput("'features' must be finite numbers")
            return rows
        return np.asarray([parse_features(request.json())], dtype=np.float64)

    def predict(self, batch: list[np.ndarray]) -> list[np.ndarray]:
        rows = np.concatenate(batch)
        if not len(rows):  # only empty v2 tensors: nothing to classify
            return [np.empty((0, len(self.class_names))) for _ in batch]
        probabilities = self.clf.predict_proba(rows)
        return np.split(probabilities, np.cumsum([len(b) for b in batch])[:-1])

    async def postprocess(self, output: np.ndarray, request: Request) -> dict[str, Any]:
        indices = np.argmax(output, axis=1)
        if request.tensors is not None:
            return {"probabilities": output.astype(np.float32), "class_index": indices,
                    "class": [self.class_names[i] for i in indices]}
        index = int(indices[0])
        return {"class": self.class_names[index], "class_index": index,
                "probabilities": [round(float(p), 6) for p in output[0]]}
