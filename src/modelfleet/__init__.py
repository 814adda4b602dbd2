"""modelfleet: serve a long-tail catalog of models on a shared pool of workers.

The model author's API lives here::

    from modelfleet import Model, Request
"""

from modelfleet.errors import InvalidInput, ModelFailed, ModelfleetError
from modelfleet.model import Context, LocalModel, Model, Output, Request

__all__ = ["Context", "InvalidInput", "LocalModel", "Model", "ModelFailed", "ModelfleetError",
           "Output", "Request"]
__version__ = "0.1.0"
