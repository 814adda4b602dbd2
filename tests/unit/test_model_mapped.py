"""Mapped array artifacts: ``ctx.map_array`` (.npy), ``ctx.map_tensors`` (safetensors),
``TorchModel.load_tensors``; and that a mapped load shares pages instead of copying them."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from modelfleet.errors import ModelLoadFailed
from modelfleet.model import Context, TorchModel


def context(folder: Path) -> Context:
    return Context("m", "1", folder, "cpu")


def test_map_array_maps_a_npy_read_only(tmp_path: Path) -> None:
    weights = np.arange(12, dtype=np.float32).reshape(3, 4)
    np.save(tmp_path / "w.npy", weights)
    mapped = context(tmp_path).map_array("w.npy")
    assert isinstance(mapped, np.memmap) and np.array_equal(mapped, weights)
    with pytest.raises(ValueError, match="read-only"):
        mapped[0, 0] = 1.0


def test_map_array_refuses_an_npz_and_says_what_to_do(tmp_path: Path) -> None:
    np.savez(tmp_path / "w.npz", W=np.ones(3))
    with pytest.raises(ModelLoadFailed, match=r"\.npz archive, which cannot be mapped.*np\.save"):
        context(tmp_path).map_array("w.npz")


def test_map_array_names_a_missing_or_foreign_file(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadFailed, match="does not exist"):
        context(tmp_path).map_array("nope.npy")
    (tmp_path / "text.npy").write_text("not numpy")
    with pytest.raises(ModelLoadFailed, match=r"not a readable \.npy array"):
        context(tmp_path).map_array("text.npy")


def test_map_tensors_maps_every_tensor_of_a_safetensors_file(tmp_path: Path) -> None:
    tensors = {
        "W1": np.random.default_rng(0).standard_normal((64, 32)).astype(np.float32),
        "b1": np.zeros(32, dtype=np.float16),
        "ids": np.arange(7, dtype=np.int64),
        "mask": np.array([True, False]),
        "empty": np.zeros((0, 4), dtype=np.float32),
        "scalar": np.array(3.5, dtype=np.float64),
    }
    save_file(tensors, str(tmp_path / "m.safetensors"), metadata={"format": "pt"})
    mapped = context(tmp_path).map_tensors("m.safetensors")
    assert set(mapped) == set(tensors)  # __metadata__ is not a tensor
    for name, expected in tensors.items():
        assert mapped[name].dtype == expected.dtype and mapped[name].shape == expected.shape
        assert np.array_equal(mapped[name], expected)
        assert not mapped[name].flags.writeable and not mapped[name].flags.owndata


@pytest.mark.parametrize(
    ("content", "match"),
    [
        (b"\x01\x02", "shorter than its header length"),
        ((10**9).to_bytes(8, "little") + b"{}", "header claims 1000000000 bytes"),
        ((5).to_bytes(8, "little") + b"{nope", "header is not JSON"),
        ((2).to_bytes(8, "little") + b"[]", "header is not a JSON object"),
    ],
)
def test_map_tensors_refuses_what_is_not_safetensors(tmp_path: Path, content: bytes,
                                                     match: str) -> None:
    (tmp_path / "bad.safetensors").write_bytes(content)
    with pytest.raises(ModelLoadFailed, match=match):
        context(tmp_path).map_tensors("bad.safetensors")


def header_file(path: Path, header: dict[str, object], data: bytes) -> None:
    raw = json.dumps(header).encode()
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + data)


def test_map_tensors_refuses_a_tensor_that_does_not_match_its_bytes(tmp_path: Path) -> None:
    header_file(tmp_path / "short.safetensors",
                {"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, b"\0" * 8)
    with pytest.raises(ModelLoadFailed, match=r"tensor 'w' \(F32 \[4\]\) does not match"):
        context(tmp_path).map_tensors("short.safetensors")
    header_file(tmp_path / "bf16.safetensors",
                {"w": {"dtype": "BF16", "shape": [2], "data_offsets": [0, 4]}}, b"\0" * 4)
    with pytest.raises(ModelLoadFailed, match=r"numpy has no bfloat16.*load_tensors"):
        context(tmp_path).map_tensors("bf16.safetensors")
    header_file(tmp_path / "odd.safetensors", {"w": {"dtype": "F32"}}, b"")
    with pytest.raises(ModelLoadFailed, match="tensor 'w' has a malformed entry"):
        context(tmp_path).map_tensors("odd.safetensors")


def test_torch_model_loads_safetensors_onto_its_device(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    from safetensors.torch import save_file as save_torch

    weight = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    save_torch({"weight": weight}, str(tmp_path / "model.safetensors"))
    model = TorchModel()
    model.load(context(tmp_path))
    tensors = model.load_tensors(context(tmp_path), "model.safetensors")
    assert tensors["weight"].device.type == "cpu" and torch.equal(tensors["weight"], weight)
    with pytest.raises(ModelLoadFailed, match="does not exist"):
        model.load_tensors(context(tmp_path), "nope.safetensors")
    (tmp_path / "bad.safetensors").write_bytes(b"\xff" * 32)
    with pytest.raises(ModelLoadFailed, match="not a readable safetensors file"):
        model.load_tensors(context(tmp_path), "bad.safetensors")


# --- a mapped load shares pages ----------------------------------------------------------

HANDLER = '''
import numpy as np
from modelfleet import Model


class Weights(Model):
    def load(self, ctx):
        if ctx.model_id == "mapped":
            self.w = ctx.map_array("artifacts/w.npy")
        else:  # the usual load: read the file and keep a private copy
            self.w = np.load(ctx.artifact("artifacts/w.npy"))

    def predict(self, batch):
        return [float(self.w.sum()) for _ in batch]  # touches every page
'''

CHILD = '''
import asyncio, gc, json, sys
from pathlib import Path

import psutil

from modelfleet.model import Request
from modelfleet.model.pipeline import handle_request
from modelfleet.repository import LocalStore
from modelfleet.runtime.host import ModelHost
from modelfleet.settings import MiB, RuntimeSettings


def rollup():
    fields = {}
    for line in open("/proc/self/smaps_rollup"):
        parts = line.split()
        if len(parts) == 3 and parts[2] == "kB":
            fields[parts[0].rstrip(":")] = int(parts[1]) * 1024
    fields["uss"] = psutil.Process().memory_full_info().uss
    return fields


async def main(root, model_id):
    # The runtime's own loading code: the store, ModelHost (measure_load, the cache), a
    # request through the batcher; then the model's eviction.
    settings = RuntimeSettings(device_budget_bytes=256 * MiB, host_budget_bytes=0)
    host = ModelHost(settings, LocalStore(Path(root)))
    before = rollup()
    loaded, _ = await host.ensure(model_id, "1")
    request = Request(b"x", "application/octet-stream")
    answer, _ = await handle_request(loaded.handler, loaded.batcher, request)
    after = rollup()
    del loaded
    assert await host.evict(model_id)
    gc.collect()
    evicted = rollup()
    return {"answer": answer, "grew": {k: after[k] - before[k] for k in after},
            "released": {k: after[k] - evicted[k] for k in after}}


print(json.dumps(asyncio.run(main(sys.argv[1], sys.argv[2]))))
'''

MB = 1 << 20


def package(root: Path, name: str) -> Path:
    folder = root / name / "1"
    (folder / "artifacts").mkdir(parents=True)
    (folder / "handler.py").write_text(HANDLER)
    (folder / "model.toml").write_text(textwrap.dedent(f'''
        name = "{name}"
        version = "1"
        entrypoint = "handler:Weights"
        description = "64 MB of weights"
        accepts = ["application/octet-stream"]
        memory_estimate_mb = 64
    '''))
    return folder


def grown(folder: Path) -> tuple[float, dict[str, int], dict[str, int]]:
    """Load ``folder``'s model in a fresh process the way a runtime does, answer one
    request, evict it: (the answer, what memory grew by, what the eviction gave back)."""
    root, model_id = folder.parent.parent, folder.parent.name
    done = subprocess.run([sys.executable, "-c", CHILD, str(root), model_id],
                          capture_output=True, text=True, timeout=120, check=True)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    return result["answer"], result["grew"], result["released"]


@pytest.mark.skipif(not Path("/proc/self/smaps_rollup").exists(), reason="needs Linux /proc")
def test_a_mapped_load_shares_pages_where_a_copying_load_grows_private_memory(
        tmp_path: Path) -> None:
    weights = np.full(16 * MB, 0.5, dtype=np.float32)  # 64 MB
    mapped, copied = package(tmp_path, "mapped"), package(tmp_path, "copied")
    for folder in (mapped, copied):
        np.save(folder / "artifacts" / "w.npy", weights)
    # Another process (this one) holds the artifact's pages mapped, as a second runtime
    # serving the same model would: pages the child maps are then shared, not its own.
    held = np.load(mapped / "artifacts" / "w.npy", mmap_mode="r")
    assert float(held.sum()) == 8 * MB

    answer, mapped_grew, mapped_released = grown(mapped)
    assert answer == 8 * MB  # every page was read
    assert mapped_grew["Rss"] >= 60 * MB  # the pages are there, in the runtime's RSS...
    assert mapped_grew["uss"] < 16 * MB  # ...but not its own: shared with this process
    assert mapped_grew["Anonymous"] < 16 * MB and mapped_grew["Private_Dirty"] < 16 * MB
    assert mapped_released["Rss"] >= 60 * MB  # evicted: the mapping left with the arrays

    answer, copied_grew, _ = grown(copied)
    assert answer == 8 * MB
    assert copied_grew["uss"] >= 60 * MB and copied_grew["Anonymous"] >= 60 * MB
    del held
