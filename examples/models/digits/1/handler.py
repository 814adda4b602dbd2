"""Handwritten digit classifier: any PNG or JPEG of one digit in, the digit out.

Trained on scikit-learn's bundled ``load_digits`` (1797 samples of 8x8 pixels,
values 0-16, bright ink on a dark background). A request's image is brought into
that form: decoded with a pixel limit checked *before* decoding, reduced to
luminance, turned bright-on-dark if it was dark-on-light, cropped to the ink,
padded to a square, area-averaged down to 8x8 and rescaled to 0-16.

The classifier is trained on the training split both as shipped and after the
same crop-pad-resize step, so it sees at train time what requests look like at
serve time. ``build_artifact`` is deterministic (fixed split, no random state
left free); ``load`` calls it when ``artifacts/model.joblib`` is missing or was
written by another scikit-learn version, so the package needs no download.
"""

from __future__ import annotations

import asyncio
import io
import os
import tempfile
import warnings
from pathlib import Path
from typing import Any

import joblib
import numpy as np
import sklearn
from PIL import Image, ImageOps
from sklearn.calibration import CalibratedClassifierCV
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from sklearn.svm import SVC

from modelfleet import Context, InvalidInput, Model, Request

ARTIFACT = "artifacts/model.joblib"
ARTIFACT_FORMAT = 1
SPLIT_SEED = 0
HELD_OUT_FRACTION = 0.25

# Checked against the header's width x height before any pixel is decoded. 40 MP
# is far more than a photo of a digit needs and bounds the decoder's memory
# (an RGBA image of that size is 160 MB).
MAX_PIXELS = 40_000_000
# Larger images are shrunk before the float work: the answer is 8x8 anyway.
WORK_SIDE_PX = 1024
# A pixel is ink when it is brighter than this fraction of the brightest one.
INK_THRESHOLD = 0.25
# Below this contrast (on the 0-255 scale) there is no digit to read.
MIN_CONTRAST = 8.0


def split_indices() -> tuple[np.ndarray, np.ndarray]:
    """Training and held-out indices into ``load_digits()``; the same on every call."""
    target = load_digits().target
    train, held_out = train_test_split(
        np.arange(len(target)),
        test_size=HELD_OUT_FRACTION,
        random_state=SPLIT_SEED,
        stratify=target,
    )
    return np.sort(train), np.sort(held_out)


def decode_image(body: bytes, max_pixels: int = MAX_PIXELS) -> np.ndarray:
    """Decode a PNG or JPEG into a 2-D float luminance array on the 0-255 scale.

    Raises ``InvalidInput`` for anything that is not a readable PNG or JPEG, and
    for an image whose header claims more than ``max_pixels`` pixels; that check
    runs on the header, so a decompression bomb is never inflated.
    """
    if not body:
        raise InvalidInput("empty body; expected a PNG or JPEG image of one digit")
    try:
        with warnings.catch_warnings():
            # Pillow warns from 89 MP on; our own, lower limit is enforced just below.
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            # formats=: only the two decoders we accept ever see the bytes.
            img = Image.open(io.BytesIO(body), formats=["PNG", "JPEG"])
    except Image.DecompressionBombError as exc:
        raise InvalidInput(f"image too large: {exc}") from exc
    except (OSError, SyntaxError, ValueError) as exc:
        raise InvalidInput(f"not a readable PNG or JPEG image: {exc}") from exc
    width, height = img.size
    if width * height > max_pixels:
        raise InvalidInput(
            f"image is {width}x{height} = {width * height} pixels; the limit is "
            f"{max_pixels} pixels: send a smaller image"
        )
    if width < 1 or height < 1:
        raise InvalidInput(f"image has no pixels ({width}x{height})")
    try:
        if img.format == "JPEG":
            # Let the JPEG decoder scale down in the DCT domain: cheaper than full size.
            img.draft(None, (WORK_SIDE_PX, WORK_SIDE_PX))
        img.load()
        img = ImageOps.exif_transpose(img)
    except (OSError, SyntaxError, ValueError, EOFError) as exc:
        raise InvalidInput(f"image data is corrupt or truncated: {exc}") from exc
    return _luminance(img)


def features_of(body: bytes) -> np.ndarray:
    """The 64 classifier features of an encoded image; ``InvalidInput`` if it has none."""
    return canonical_digit(decode_image(body))


def _luminance(img: Image.Image) -> np.ndarray:
    """One float channel on the 0-255 scale; transparency composited over a background
    that contrasts with the ink."""
    if img.mode in ("I", "I;16", "I;16B", "I;16L", "I;16N", "F"):
        # 16-bit grayscale PNG: keep the precision, bring it to the 0-255 scale.
        img = img.convert("F")
        img.thumbnail((WORK_SIDE_PX, WORK_SIDE_PX), Image.Resampling.BOX)
        return np.asarray(img, dtype=np.float64) * (255.0 / 65535.0)
    has_alpha = "A" in img.getbands() or "transparency" in img.info
    if not has_alpha:
        img = img.convert("L")
        img.thumbnail((WORK_SIDE_PX, WORK_SIDE_PX), Image.Resampling.BOX)
        return np.asarray(img, dtype=np.float64)
    img = img.convert("LA")
    img.thumbnail((WORK_SIDE_PX, WORK_SIDE_PX), Image.Resampling.BOX)
    la = np.asarray(img, dtype=np.float64)
    lum, alpha = la[..., 0], la[..., 1] / 255.0
    if alpha.min() >= 1.0:
        return lum
    # Transparent pixels are background. Put them on white under dark ink and on
    # black under light ink, so the ink keeps its contrast.
    weight = alpha.sum()
    ink_mean = float((lum * alpha).sum() / weight) if weight > 0 else 0.0
    background = 255.0 if ink_mean < 128.0 else 0.0
    return alpha * lum + (1.0 - alpha) * background


def canonical_digit(lum: np.ndarray) -> np.ndarray:
    """Bright-on-dark, cropped to the ink, square, 8x8, values 0-16: 64 features.

    ``lum`` is a 2-D luminance array on the 0-255 scale. Raises ``InvalidInput``
    when it is blank (too little contrast to find a digit in).
    """
    a = np.asarray(lum, dtype=np.float64)
    # The training digits are bright on dark. The background dominates the border,
    # so a border brighter than the whole image means dark ink on light paper.
    if _border(a).mean() > a.mean():
        a = 255.0 - a
    a = np.clip(a - np.median(_border(a)), 0.0, None)
    peak = float(a.max())
    if peak < MIN_CONTRAST:
        raise InvalidInput("the image looks blank: no digit found (too little contrast)")
    a /= peak
    rows, cols = np.nonzero(a > INK_THRESHOLD)
    a = a[rows.min() : rows.max() + 1, cols.min() : cols.max() + 1]
    height, width = a.shape
    side = max(height, width)
    square = np.zeros((side, side))
    top, left = (side - height) // 2, (side - width) // 2
    square[top : top + height, left : left + width] = a
    # BOX is an area average, like the 4x4 block counts the training data was made of.
    small = Image.fromarray(np.round(square * 255.0).astype(np.uint8)).resize(
        (8, 8), Image.Resampling.BOX
    )
    out = np.asarray(small, dtype=np.float64)
    return (out * (16.0 / max(float(out.max()), 1e-12))).ravel()


def _border(a: np.ndarray) -> np.ndarray:
    return np.concatenate([a[0], a[-1], a[:, 0], a[:, -1]])


def _upscaled(sample: np.ndarray) -> np.ndarray:
    """An 8x8 training sample as a 32x32 luminance image, to run it through the crop step."""
    img = Image.fromarray((sample * (255.0 / 16.0)).astype(np.uint8))
    return np.asarray(img.resize((32, 32), Image.Resampling.BILINEAR), dtype=np.float64)


def train_classifier() -> CalibratedClassifierCV:
    """Fit the classifier on the training split; deterministic."""
    digits = load_digits()
    train, _ = split_indices()
    raw = digits.images[train].reshape(len(train), -1)
    canon = np.stack([canonical_digit(_upscaled(s)) for s in digits.images[train]])
    features = np.vstack([raw, canon])
    labels = np.concatenate([digits.target[train], digits.target[train]])
    # SVC's own probability=True is deprecated; calibrating one SVC on folds
    # (ensemble=False) is its documented replacement. No shuffling: deterministic.
    clf = CalibratedClassifierCV(SVC(kernel="rbf", C=10.0, gamma="scale"), ensemble=False, cv=5)
    return clf.fit(features, labels)


def build_artifact(path: Path) -> dict[str, Any]:
    """Train and write the artifact atomically (temp file, then ``os.replace``)."""
    artifact = {
        "format": ARTIFACT_FORMAT,
        "sklearn_version": sklearn.__version__,
        "classifier": train_classifier(),
    }
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
            warnings.simplefilter("ignore")  # an old pickle's version warning: we check below
            artifact = joblib.load(path)
        if (
            isinstance(artifact, dict)
            and artifact.get("format") == ARTIFACT_FORMAT
            and artifact.get("sklearn_version") == sklearn.__version__
        ):
            return artifact
    except Exception:  # missing, damaged or foreign: building it costs two seconds
        pass
    return build_artifact(path)


class DigitClassifier(Model):
    """PNG or JPEG of one digit -> ``{"digit": d, "probabilities": [10 floats]}`` on /v1;
    on /v2, rows of 8x8 pixels (0-16, scikit-learn's digits format) -> probabilities, with
    labels for the classification extension (``labels.txt``)."""

    def load(self, ctx: Context) -> None:
        self.clf = load_or_build(ctx.artifact(ARTIFACT))["classifier"]

    async def preprocess(self, request: Request) -> np.ndarray:
        if request.tensors is not None:  # /v2: already pixels, [rows, 64]
            return np.asarray(request.tensors["pixels"], dtype=np.float64)
        # Decoding is CPU work; a thread keeps this event loop free for other requests.
        return await asyncio.to_thread(features_of, request.body)

    def predict(self, batch: list[np.ndarray]) -> list[np.ndarray]:
        # One image (a row) from /v1, rows from /v2: one predict_proba over all of them.
        rows = [item.reshape(-1, 64) for item in batch]
        scores = self._probabilities(np.vstack(rows))
        cuts = np.cumsum([len(r) for r in rows])[:-1]
        return [part if item.ndim == 2 else part[0]
                for item, part in zip(batch, np.split(scores, cuts), strict=True)]

    def _probabilities(self, features: np.ndarray) -> np.ndarray:
        """[rows, 10]: a probability for every digit, classes the classifier never saw 0."""
        out = np.zeros((len(features), 10))
        out[:, [int(c) for c in self.clf.classes_]] = self.clf.predict_proba(features)
        return out

    async def postprocess(self, output: np.ndarray, request: Request) -> Any:
        if request.tensors is not None:
            return {"probabilities": output}
        probabilities = [round(float(p), 6) for p in output]
        return {"digit": int(np.argmax(output)), "probabilities": probabilities}
