"""The Open Inference Protocol v2 (KServe V2) data plane's tensor codec: pure, no I/O.

- ``datatypes``: the v2 datatypes and their numpy dtypes;
- ``codec``: request and response bodies (JSON tensors and the binary tensor extension)
  to and from numpy arrays, with a ``RequestRejected`` for every malformed body;
- ``signature``: a request checked against a model's declared inputs and outputs.

``OIP_CONTENT_TYPE`` is how a v2 request travels from the gateway to the runtime: the
body unchanged, and when it has a binary part, the JSON header's length in the task's
parameter ``HEADER_LENGTH_PARAM``.
"""

from typing import Final

OIP_CONTENT_TYPE: Final = "application/vnd.modelfleet.oip-v2"
HEADER_LENGTH_PARAM: Final = "oip.header_length"
