"""The Open Inference Protocol v2 (KServe V2) data plane's tensor codec: pure, no I/O.

- ``datatypes``: the v2 datatypes and their numpy dtypes;
- ``tensor``: one tensor's data, JSON or binary, to and from a numpy array;
- ``codec``: request and response bodies (JSON tensors and the binary tensor extension)
  to and from numpy arrays, with a ``RequestRejected`` for every malformed body;
- ``signature``: a request checked against a model's declared inputs and outputs.

``OIP_CONTENT_TYPE`` is how a v2 request travels from the gateway to the runtime: the
body unchanged, and when it has a binary part, the JSON header's length in the task's
parameter ``HEADER_LENGTH_PARAM``.
"""

from typing import Final, Literal, get_args

OIP_CONTENT_TYPE: Final = "application/vnd.modelfleet.oip-v2"
# The v2 datatype names. Here, not in ``datatypes``, so that the manifest (read in
# isolated runtimes' own environments, which need not have numpy) imports no numpy.
Datatype = Literal["BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32",
                   "INT64", "FP16", "FP32", "FP64", "BYTES"]
DATATYPES: Final[tuple[str, ...]] = get_args(Datatype)
HEADER_LENGTH_PARAM: Final = "oip.header_length"
