"""The model control API from an unmodified tritonclient: list, load, metadata, infer, unload.

    make serve                                   # in another terminal
    python examples/tritonclient_control.py      # or: ... HOST:PORT

Each step prints one line. ``load_model`` returns once iris is warm on a worker;
after ``unload_model`` its requests are refused until it is loaded again.
"""

from __future__ import annotations

import sys

import numpy as np
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

url = sys.argv[1] if len(sys.argv) > 1 else "localhost:8000"
client = httpclient.InferenceServerClient(url)

index = client.get_model_repository_index()
print("index:", ", ".join(f"{m['name']} {m['state']}" for m in index))

client.load_model("iris")
print("loaded: iris ready =", client.is_model_ready("iris"))

metadata = client.get_model_metadata("iris")
print("metadata:", [(t["name"], t["datatype"], t["shape"]) for t in metadata["inputs"]],
      "->", [t["name"] for t in metadata["outputs"]])

features = httpclient.InferInput("features", [2, 4], "FP32")
features.set_data_from_numpy(np.array([[5.1, 3.5, 1.4, 0.2], [6.7, 3.0, 5.2, 2.3]],
                                      dtype=np.float32))
result = client.infer("iris", [features])
print("infer:", [c.decode() for c in result.as_numpy("class")])

client.unload_model("iris")
print("unloaded: iris ready =", client.is_model_ready("iris"))
try:
    client.infer("iris", [features])
except InferenceServerException as exc:
    print("refused:", exc.message())

client.load_model("iris")
print("loaded again: iris ready =", client.is_model_ready("iris"))
