"""The model author's API, in one package.

- ``api``: ``Model`` (subclass it: ``load``, ``predict``, optional async
  ``preprocess``/``postprocess``), ``Request``, ``Context``, ``Output``;
- ``tiers``: what a handler may declare to the memory tiers (``SizedModel``,
  ``TierMovable``);
- ``torch_support``: ``TorchModel``, torch modules movable between tiers (torch is
  imported only when one is used);
- ``pipeline``: one request's path through a handler (batched ``predict``), the same
  code in the runtime and in ``LocalModel``;
- ``importer``: the handler class a manifest's ``entrypoint`` names;
- ``local``: ``LocalModel``, a package run in-process for a model author's tests.

Nothing here imports a web framework, a broker or the runtime.
"""

from modelfleet.model.api import Context, Model, Output, Request
from modelfleet.model.local import LocalModel
from modelfleet.model.tiers import SizedModel, TierMovable
from modelfleet.model.torch_support import TorchModel

__all__ = ["Context", "LocalModel", "Model", "Output", "Request", "SizedModel", "TierMovable",
           "TorchModel"]
