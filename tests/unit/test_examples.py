"""The example model packages, run in-process through ``LocalModel`` (no server)."""

from __future__ import annotations

import asyncio
import importlib.util
import io
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import zlib
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest
from PIL import Image, ImageFile

from modelfleet import InvalidInput, LocalModel, Output
from modelfleet.errors import ModelfleetError, RequestRejected
from modelfleet.model import Request
from modelfleet.model.importer import import_handler
from modelfleet.model.local import run_pipeline
from modelfleet.repository.manifest import load_manifest

ROOT = Path(__file__).resolve().parents[2]
MODELS = ROOT / "examples" / "models"
FIXTURES = ROOT / "tests" / "fixtures" / "digits"
LABELS: dict[str, dict[str, Any]] = json.loads((FIXTURES / "labels.json").read_text())
PACKAGES = sorted(p.parent for p in MODELS.glob("*/*/model.toml"))


def _import_by_path(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


render = _import_by_path("modelfleet_test_digit_render", FIXTURES / "render.py")


def handler_module(model: LocalModel) -> ModuleType:
    return sys.modules[type(model.handler).__module__]


def content_type(name: str) -> str:
    return "image/jpeg" if name.endswith((".jpg", ".jpeg")) else "image/png"


def as_json(value: Any) -> bytes:
    return json.dumps(value).encode()


# --- every package ---------------------------------------------------------------


def test_all_seven_example_packages_exist() -> None:
    names = {p.parent.name for p in PACKAGES}
    assert names >= {"digits", "iris", "banner", "enrich", "crasher", "slowload", "broken"}


@pytest.mark.parametrize("package", PACKAGES, ids=lambda p: p.parent.name)
def test_package_manifest_is_valid_and_its_entrypoint_imports(package: Path) -> None:
    manifest = load_manifest(package / "model.toml")
    assert manifest.name == package.parent.name
    assert manifest.version == package.name
    assert manifest.tenant == "examples"
    assert manifest.description
    import_handler(manifest, package)  # a Model subclass, or ModelLoadFailed


@pytest.mark.parametrize("name", ["digits", "iris"])
def test_tabular_and_image_models_batch_16_within_2_ms(name: str) -> None:
    batching = load_manifest(MODELS / name / "1" / "model.toml").batching
    assert (batching.max_batch_size, batching.max_delay_ms) == (16, 2)


def test_readme_documents_every_model_with_a_curl_example() -> None:
    readme = (MODELS / "README.md").read_text().replace("\\\n", " ")  # join continued lines
    for package in PACKAGES:
        name = package.parent.name
        assert re.search(rf"curl .*/v1/models/{name}/infer", readme), name


# --- digits ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def digits() -> LocalModel:
    return LocalModel.from_package(MODELS / "digits" / "1")


@pytest.mark.parametrize("name", sorted(LABELS))
def test_digits_reads_each_fixture_image(digits: LocalModel, name: str) -> None:
    result = digits.infer((FIXTURES / name).read_bytes(), content_type(name))
    assert result["digit"] == LABELS[name]["digit"]
    assert len(result["probabilities"]) == 10
    assert sum(result["probabilities"]) == pytest.approx(1.0, abs=1e-4)
    assert result["probabilities"][result["digit"]] == max(result["probabilities"])


def test_fixtures_cover_both_polarities_and_every_format() -> None:
    styles = {info["style"] for info in LABELS.values()}
    assert len(LABELS) >= 12
    assert {info["digit"] for info in LABELS.values()} == set(range(10))
    assert any("dark_on_light" in s for s in styles) and any("light_on_dark" in s for s in styles)
    modes = {Image.open(FIXTURES / n).mode for n in LABELS}
    formats = {Image.open(FIXTURES / n).format for n in LABELS}
    assert {"L", "RGB", "RGBA", "P"} <= modes
    assert formats == {"PNG", "JPEG"}


def test_digits_reads_the_readme_seven(digits: LocalModel) -> None:
    assert digits.infer((ROOT / "examples" / "seven.png").read_bytes(), "image/png")["digit"] == 7


async def test_digits_is_right_on_at_least_90_percent_of_100_held_out_renderings(
    digits: LocalModel,
) -> None:
    """100 held-out samples, drawn at random, each rendered in a randomly drawn style."""
    from sklearn.datasets import load_digits

    data = load_digits()
    _, held_out = handler_module(digits).split_indices()
    rng = np.random.default_rng(20240611)
    picks = rng.choice(held_out, size=100, replace=False)
    styles = rng.integers(0, len(render.STYLES), size=100)
    items = []
    for index, style in zip(picks, styles, strict=True):
        spec = render.STYLES[int(style)]
        items.append((render.render(data.images[index], spec),
                      "image/jpeg" if spec.fmt == "JPEG" else "image/png"))
    results = []
    for start in range(0, 100, 16):  # batches, as the runtime would send them
        results += await digits.ainfer_many(items[start : start + 16])
    correct = sum(r["digit"] == data.target[i] for r, i in zip(results, picks, strict=True))
    assert correct >= 90, f"{correct}/100 held-out renderings right"


def test_digits_held_out_split_is_disjoint_from_training_and_stable(digits: LocalModel) -> None:
    module = handler_module(digits)
    train, held_out = module.split_indices()
    again_train, again_held_out = module.split_indices()
    assert not set(train) & set(held_out)
    assert len(train) + len(held_out) == 1797
    assert np.array_equal(held_out, again_held_out) and np.array_equal(train, again_train)


def test_digits_reads_16_bit_grayscale(digits: LocalModel) -> None:
    name = "zero_png_gray_dark_on_light.png"
    gray = np.asarray(Image.open(FIXTURES / name).convert("L"), dtype=np.uint16) * 257
    out = io.BytesIO()
    Image.fromarray(gray).save(out, "PNG")  # mode I;16
    assert Image.open(io.BytesIO(out.getvalue())).mode.startswith("I")
    assert digits.infer(out.getvalue(), "image/png")["digit"] == 0


def _encoded(img: Image.Image, fmt: str) -> bytes:
    out = io.BytesIO()
    img.save(out, fmt)
    return out.getvalue()


def _zero() -> Image.Image:
    return Image.open(FIXTURES / "zero_png_gray_dark_on_light.png").convert("L")


def _white_ink_on_transparent() -> Image.Image:
    img = Image.new("RGBA", (64, 64), (255, 255, 255, 0))
    img.putalpha(Image.eval(_zero(), lambda v: 255 - v))
    return img


def _small_digit_on_big_page() -> Image.Image:
    page = Image.new("L", (3000, 2000), 255)
    page.paste(_zero().resize((120, 120)), (1700, 300))
    return page


@pytest.mark.parametrize(
    ("make", "fmt"),
    [
        (lambda: _zero().convert("CMYK"), "JPEG"),
        (lambda: _zero().convert("1"), "PNG"),
        (lambda: _zero().convert("LA"), "PNG"),
        (_white_ink_on_transparent, "PNG"),
        (_small_digit_on_big_page, "PNG"),
        (_small_digit_on_big_page, "JPEG"),
    ],
    ids=["cmyk-jpeg", "bilevel-png", "gray-alpha-png", "white-ink-on-transparent",
         "small-digit-big-png", "small-digit-big-jpeg"],
)
def test_digits_reads_other_modes_and_layouts(digits: LocalModel, make: Any, fmt: str) -> None:
    body = _encoded(make(), fmt)
    assert digits.infer(body, f"image/{fmt.lower()}")["digit"] == 0


def test_digits_answers_or_rejects_every_mangled_image(digits: LocalModel) -> None:
    """Flipped, cut and inserted bytes: a digit or InvalidInput, never another error."""
    rng = np.random.default_rng(5)
    files = sorted(FIXTURES.glob("*.[pj][np]g"))
    features_of = handler_module(digits).features_of
    outcomes = {"answer": 0, "invalid": 0}
    for _ in range(300):
        data = bytearray(files[rng.integers(len(files))].read_bytes())
        kind = rng.integers(3)
        if kind == 0:
            for at in rng.integers(0, len(data), size=rng.integers(1, 9)):
                data[at] = rng.integers(256)
        elif kind == 1:
            data = data[: rng.integers(len(data))]
        else:
            at = int(rng.integers(len(data)))
            data[at:at] = rng.integers(0, 256, size=rng.integers(1, 50)).astype(np.uint8).tobytes()
        try:
            assert features_of(bytes(data)).shape == (64,)
            outcomes["answer"] += 1
        except InvalidInput:
            outcomes["invalid"] += 1
    assert outcomes["answer"] and outcomes["invalid"]


def test_digits_batch_isolates_a_corrupt_image(digits: LocalModel) -> None:
    good = (FIXTURES / "three_jpeg_light_on_dark.jpg").read_bytes()
    requests = [Request(good, "image/jpeg"), Request(b"\x89PNG garbage", "image/png"),
                Request(good, "image/jpeg")]
    results = asyncio.run(run_pipeline(digits.handler, requests))
    assert results[0]["digit"] == 3 and results[2]["digit"] == 3
    assert isinstance(results[1], InvalidInput)


def _png_bytes(name: str = "seven_png_palette_dark_on_light.png") -> bytes:
    return (FIXTURES / name).read_bytes()


@pytest.mark.parametrize(
    ("body", "match"),
    [
        (b"", "empty body"),
        (b"this is not an image", "not a readable PNG or JPEG"),
        (b"GIF89a\x01\x00\x01\x00\x00\x00\x00;", "not a readable PNG or JPEG"),
        (_png_bytes()[: len(_png_bytes()) // 2], "corrupt or truncated"),
        ((FIXTURES / "four_jpeg_blue_ink_on_cream.jpg").read_bytes()[:1200],
         "corrupt or truncated"),
    ],
    ids=["empty", "garbage", "gif", "truncated-png", "truncated-jpeg"],
)
def test_digits_rejects_unreadable_images(digits: LocalModel, body: bytes, match: str) -> None:
    with pytest.raises(InvalidInput, match=match):
        digits.infer(body, "image/png")


def test_digits_rejects_a_png_with_a_corrupt_data_chunk(digits: LocalModel) -> None:
    data = bytearray(_png_bytes("zero_png_gray_dark_on_light.png"))
    idat = data.index(b"IDAT")
    data[idat + 10 : idat + 30] = b"\xff" * 20  # inside the compressed stream
    with pytest.raises(InvalidInput):
        digits.infer(bytes(data), "image/png")


def test_digits_rejects_a_blank_image(digits: LocalModel) -> None:
    out = io.BytesIO()
    Image.new("L", (64, 64), 255).save(out, "PNG")
    with pytest.raises(InvalidInput, match="blank"):
        digits.infer(out.getvalue(), "image/png")


def _png_header_only(width: int, height: int) -> bytes:
    """A PNG whose IHDR claims ``width`` x ``height`` and that carries no pixel data."""

    def chunk(kind: bytes, payload: bytes) -> bytes:
        crc = zlib.crc32(kind + payload) & 0xFFFFFFFF
        return struct.pack(">I", len(payload)) + kind + payload + struct.pack(">I", crc)

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)  # 8-bit grayscale
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IEND", b"")


def _jpeg_claiming(width: int, height: int) -> bytes:
    """A real small JPEG whose frame header (SOF0) is patched to claim another size."""
    out = io.BytesIO()
    Image.new("L", (16, 16), 0).save(out, "JPEG")
    data = bytearray(out.getvalue())
    sof = data.index(b"\xff\xc0")
    data[sof + 5 : sof + 9] = struct.pack(">HH", height, width)
    return bytes(data)


@pytest.fixture
def no_decoding(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(self: ImageFile.ImageFile) -> None:
        raise AssertionError("pixel data was decoded; the size check must come first")

    monkeypatch.setattr(ImageFile.ImageFile, "load", refuse)


@pytest.mark.parametrize(
    ("body", "ctype"),
    [
        (_png_header_only(8000, 6000), "image/png"),  # 48 MP: over our limit
        (_png_header_only(50_000, 50_000), "image/png"),  # 2.5 GP: over Pillow's own too
        (_jpeg_claiming(9000, 9000), "image/jpeg"),  # 81 MP
    ],
    ids=["png-48mp", "png-2.5gp", "jpeg-81mp"],
)
def test_digits_rejects_decompression_bomb_from_the_header(
    digits: LocalModel, no_decoding: None, body: bytes, ctype: str
) -> None:
    with pytest.raises(InvalidInput, match=r"too large|limit"):
        digits.infer(body, ctype)


def test_digits_builds_the_same_artifact_at_first_load(digits: LocalModel, tmp_path: Path) -> None:
    package = tmp_path / "digits" / "1"
    package.mkdir(parents=True)
    for name in ("model.toml", "handler.py", "labels.txt"):
        shutil.copy(MODELS / "digits" / "1" / name, package / name)
    fresh = LocalModel.from_package(package)  # no artifact here: load builds it
    assert [p.name for p in (package / "artifacts").iterdir()] == ["model.joblib"]
    features_of = handler_module(digits).features_of
    features = np.stack([features_of((FIXTURES / name).read_bytes()) for name in sorted(LABELS)])
    assert np.array_equal(fresh.handler.clf.predict_proba(features),
                          digits.handler.clf.predict_proba(features))


# --- iris --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def iris() -> LocalModel:
    return LocalModel.from_package(MODELS / "iris" / "1")


@pytest.mark.parametrize(
    ("features", "expected"),
    [
        ([5.1, 3.5, 1.4, 0.2], "setosa"),
        ([4.9, 3.0, 1.4, 0.2], "setosa"),
        ([7.0, 3.2, 4.7, 1.4], "versicolor"),
        ([5.7, 2.8, 4.1, 1.3], "versicolor"),
        ([6.3, 3.3, 6.0, 2.5], "virginica"),
        ([7.7, 3.0, 6.1, 2.3], "virginica"),
    ],
)
def test_iris_classifies_canonical_samples(
    iris: LocalModel, features: list[float], expected: str
) -> None:
    result = iris.infer(as_json({"features": features}), "application/json")
    assert result["class"] == expected
    assert result["class_index"] == ["setosa", "versicolor", "virginica"].index(expected)
    assert sum(result["probabilities"]) == pytest.approx(1.0, abs=1e-4)


async def test_iris_batch_answers_each_request_in_order(iris: LocalModel) -> None:
    items = [(as_json({"features": f}), "application/json")
             for f in ([6.3, 3.3, 6.0, 2.5], [5.1, 3.5, 1.4, 0.2], [7.0, 3.2, 4.7, 1.4])]
    results = await iris.ainfer_many(items)
    assert [r["class"] for r in results] == ["virginica", "setosa", "versicolor"]


@pytest.mark.parametrize(
    ("body", "match"),
    [
        (b"{not json", "not valid JSON"),
        (b"\xff\xfe", "not valid JSON"),
        (as_json([5.1, 3.5, 1.4, 0.2]), "expected a JSON object"),
        (as_json({"values": [5.1, 3.5, 1.4, 0.2]}), "expected a JSON object"),
        (as_json({"features": [5.1, 3.5, 1.4]}), "list of 4 numbers, got 3 items"),
        (as_json({"features": "5.1,3.5,1.4,0.2"}), "list of 4 numbers, got str"),
        (as_json({"features": [5.1, "wide", 1.4, 0.2]}), "sepal_width_cm must be a number"),
        (as_json({"features": [5.1, 3.5, True, 0.2]}), "petal_length_cm must be a number"),
        (b'{"features": [5.1, 3.5, NaN, 0.2]}', "must be finite"),
        (as_json({"features": [5.1, 3.5, 1.4, 0.2], "extra": 1}), "unknown field"),
    ],
)
def test_iris_says_what_it_expected_on_bad_input(iris: LocalModel, body: bytes, match: str) -> None:
    with pytest.raises(InvalidInput, match=match):
        iris.infer(body, "application/json")


# --- banner ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def banner() -> LocalModel:
    return LocalModel.from_package(MODELS / "banner" / "1")


def test_banner_wraps_the_text_in_a_bubble(banner: LocalModel) -> None:
    out = banner.infer(b"hello, fleet!", "text/plain")
    assert isinstance(out, Output)
    assert out.content_type == "text/plain; charset=utf-8"
    text = out.body.decode("utf-8")
    assert "< hello, fleet! >" in text
    assert text.splitlines()[0] == " " + "_" * len("hello, fleet!  ")


def test_banner_wraps_long_text_at_40_columns_and_keeps_every_word(banner: LocalModel) -> None:
    words = ("modelfleet serves a long-tail catalog of models on a shared pool of workers, "
             "behind an HTTP API that looks synchronous to the caller.")
    lines = banner.infer(words.encode(), "text/plain").body.decode().splitlines()
    bubble = [line for line in lines if line[:1] in "/|\\" and line[-1:] in "/|\\"]
    assert len(bubble) >= 3
    assert len({len(line) for line in bubble}) == 1  # aligned right border
    assert all(len(line) <= 40 + 4 for line in bubble)
    assert " ".join(line[2:-2].strip() for line in bubble) == words


def test_banner_keeps_wide_characters_aligned(banner: LocalModel) -> None:
    module = handler_module(banner)
    lines = module.banner("日本語 and ascii\nsecond line").splitlines()
    bubble = lines[1:3]
    assert len({module.display_width(line) for line in bubble}) == 1


@pytest.mark.parametrize("body", [b"", b"   \n\t ", b"\x00\x07"], ids=["empty", "blank", "ctrl"])
def test_banner_rejects_empty_text(banner: LocalModel, body: bytes) -> None:
    with pytest.raises(InvalidInput, match="empty text"):
        banner.infer(body, "text/plain")


def test_banner_rejects_bytes_that_are_not_utf8(banner: LocalModel) -> None:
    with pytest.raises(InvalidInput, match="UTF-8"):
        banner.infer(b"caf\xe9", "text/plain")


def test_banner_does_not_import_numpy() -> None:
    code = (
        "import sys\n"
        "from modelfleet import LocalModel\n"
        "before = 'numpy' in sys.modules\n"
        f"LocalModel.from_package({str(MODELS / 'banner' / '1')!r}).infer(b'hi', 'text/plain')\n"
        "print(before, 'numpy' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, check=True)
    before, after = done.stdout.split()
    assert after == before, "loading banner imported numpy"


# --- embed -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def embed() -> LocalModel:
    return LocalModel.from_package(MODELS / "embed" / "1")


def embedding(model: LocalModel, text: str) -> np.ndarray:
    answer = model.infer(text.encode(), "text/plain")
    assert answer["dim"] == 64 and len(answer["embedding"]) == 64
    return np.asarray(answer["embedding"])


def test_embed_texts_sharing_words_point_the_same_way(embed: LocalModel) -> None:
    cat = embedding(embed, "The cat sat on the mat.")
    kitten = embedding(embed, "a cat sat on a mat")
    markets = embedding(embed, "Stock markets fell sharply today")
    assert abs(float(np.linalg.norm(cat)) - 1.0) < 1e-5
    assert float(cat @ kitten) > 0.5 > abs(float(cat @ markets))
    # Case and punctuation do not matter; the same text gives the same vector.
    assert np.array_equal(cat, embedding(embed, "the CAT sat on the mat"))


def test_embed_maps_its_projection_instead_of_copying_it(embed: LocalModel) -> None:
    projection = embed.handler.projection  # type: ignore[attr-defined]
    assert projection.shape == (1 << 16, 64) and projection.nbytes == 16 * 1024 * 1024
    assert not projection.flags.writeable and not projection.flags.owndata
    with pytest.raises(ValueError, match="read-only"):
        projection[0, 0] = 1.0  # the artifact cannot be changed through the model


@pytest.mark.parametrize("body", [b"", b"   ", b"!!! ???"])
def test_embed_rejects_text_without_words(embed: LocalModel, body: bytes) -> None:
    with pytest.raises(InvalidInput, match="no words"):
        embed.infer(body, "text/plain")


def test_embed_rebuilds_a_damaged_artifact(tmp_path: Path) -> None:
    package = tmp_path / "embed" / "1"
    shutil.copytree(MODELS / "embed" / "1", package,
                    ignore=shutil.ignore_patterns("artifacts", "__pycache__"))
    (package / "artifacts").mkdir()
    (package / "artifacts" / "projection.safetensors").write_bytes(b"\xff" * 64)
    model = LocalModel.from_package(package)
    fresh = LocalModel.from_package(MODELS / "embed" / "1")
    text = "rebuilt the same, deterministically"
    assert np.array_equal(embedding(model, text), embedding(fresh, text))


# --- enrich ------------------------------------------------------------------------

LOOKUP_LATENCY_MS = 500  # long enough that 20 lookups all start before the first ends


@pytest.fixture(scope="module")
def enrich() -> Iterator[LocalModel]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MODELFLEET_EXAMPLE_ENRICH_LATENCY_MS", str(LOOKUP_LATENCY_MS))
        model = LocalModel.from_package(MODELS / "enrich" / "1")
    yield model
    model.handler.unload()


async def test_enrich_overlaps_twenty_concurrent_lookups(enrich: LocalModel) -> None:
    service = enrich.handler.service
    service.reset_stats()
    entities = [f"user-{n}" for n in range(100, 120)]
    results = await asyncio.gather(
        *(enrich.ainfer(as_json({"entity": e}), "application/json") for e in entities)
    )
    expected = handler_module(enrich).generate_features()
    assert [r["entity"] for r in results] == entities
    assert all(r["features"] == expected[r["entity"]] for r in results)
    assert all(0.0 < r["score"] < 1.0 for r in results)
    assert service.served == 20
    # Served one at a time, max_in_flight would be 1 and the wait 20 latencies.
    assert service.max_in_flight == 20


def test_enrich_features_are_generated_deterministically(enrich: LocalModel) -> None:
    module = handler_module(enrich)
    assert module.generate_features() == module.generate_features()
    assert enrich.infer(as_json({"entity": "user-42"}), "application/json")["features"] == {
        "account_age_days": 3582, "orders_90d": 26, "returns_90d": 4,
        "avg_order_eur": 101.77, "country": "NL",
    }


@pytest.mark.parametrize(
    ("body", "match"),
    [
        (as_json({"entity": "user-5000"}), "unknown entity 'user-5000'"),
        (as_json({"entity": "nobody"}), "unknown entity"),
        (as_json({"entity": 42}), "expected a JSON object"),
        (as_json({"user": "user-1"}), "expected a JSON object"),
        (as_json({"entity": "../../etc/passwd"}), "expected a JSON object"),
        (b"user-42", "not valid JSON"),
    ],
)
def test_enrich_rejects_unknown_or_malformed_entities(
    enrich: LocalModel, body: bytes, match: str
) -> None:
    with pytest.raises(InvalidInput, match=match):
        enrich.infer(body, "application/json")


def test_enrich_unload_stops_the_feature_service() -> None:
    model = LocalModel.from_package(MODELS / "enrich" / "1")
    service = model.handler.service
    assert service.port > 0
    model.handler.unload()
    assert not service._thread.is_alive()
    with pytest.raises(ModelfleetError, match="feature service unreachable"):
        model.infer(as_json({"entity": "user-1"}), "application/json")


# --- crasher, slowload, broken -------------------------------------------------------


def test_crasher_echoes_ordinary_text() -> None:
    model = LocalModel.from_package(MODELS / "crasher" / "1")
    assert model.infer(b"hello", "text/plain") == {"echo": "hello"}
    assert model.infer(b"crash", "text/plain") == {"echo": "crash"}


def test_crasher_kills_its_own_process_on_crash() -> None:
    # In a child process, of course: os._exit would take pytest with it.
    code = (
        "from modelfleet import LocalModel\n"
        f"m = LocalModel.from_package({str(MODELS / 'crasher' / '1')!r})\n"
        "m.infer(b'CRASH', 'text/plain')\n"
        "print('still alive')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 13
    assert "still alive" not in done.stdout


def test_slowload_echoes_json_after_its_load(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MODELFLEET_EXAMPLE_SLOWLOAD_S", "0.05")
    model = LocalModel.from_package(MODELS / "slowload" / "1")
    assert model.handler.load_s == 0.05
    assert type(model.handler).loads_started >= 1
    assert model.infer(b'{"a": [1, 2]}', "application/json") == {"echo": {"a": [1, 2]}}


def test_slowload_ends_its_load_once_the_release_file_exists(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    release = tmp_path / "release"
    release.touch()
    monkeypatch.setenv("MODELFLEET_EXAMPLE_SLOWLOAD_S", "600")
    monkeypatch.setenv("MODELFLEET_EXAMPLE_SLOWLOAD_RELEASE", str(release))
    model = LocalModel.from_package(MODELS / "slowload" / "1")  # not 600 s
    assert model.infer(b'{"a": 1}', "application/json") == {"echo": {"a": 1}}


def test_slowload_default_is_three_seconds(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MODELFLEET_EXAMPLE_SLOWLOAD_S", raising=False)
    manifest = load_manifest(MODELS / "slowload" / "1" / "model.toml")
    module = sys.modules[import_handler(manifest, MODELS / "slowload" / "1").__module__]
    assert module.load_seconds() == 3.0


@pytest.mark.parametrize("value", ["soon", "-1"])
def test_slowload_rejects_a_bad_load_time(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("MODELFLEET_EXAMPLE_SLOWLOAD_S", value)
    with pytest.raises(Exception, match="MODELFLEET_EXAMPLE_SLOWLOAD_S"):
        LocalModel.from_package(MODELS / "slowload" / "1")


def test_broken_fails_to_load_naming_the_cause_every_time() -> None:
    for _ in range(2):  # nothing is cached: a second attempt fails the same way
        with pytest.raises(Exception) as info:
            LocalModel.from_package(MODELS / "broken" / "1")
        message = str(info.value)
        assert "weights.json is format_version 3" in message
        assert "reads only format_version 2" in message
        assert not isinstance(info.value, RequestRejected)  # not the caller's fault


def test_build_scripts_write_the_artifact(tmp_path: Path) -> None:
    for name in ("iris",):  # digits' build runs above through load; iris is quick
        package = tmp_path / name
        shutil.copytree(MODELS / name / "1", package,
                        ignore=shutil.ignore_patterns("artifacts", "__pycache__"))
        subprocess.run([sys.executable, str(package / "build.py")], check=True, timeout=120,
                       capture_output=True, env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"})
        assert (package / "artifacts" / "model.joblib").stat().st_size > 0
