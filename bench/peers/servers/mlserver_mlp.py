"""The `mlserver` peer's custom runtime: an MLServer ``MLModel`` serving one catalog MLP.

Each model folder's ``model-settings.json`` names this class and the model's weights
(``parameters.uri``). The request is a V2 inference request with one FP32 input of shape
[1, 64]; the answer one FP32 output ``logits`` of shape [1, 10].
"""

from __future__ import annotations

import mlp
from mlserver import MLModel
from mlserver.codecs import NumpyCodec
from mlserver.types import InferenceRequest, InferenceResponse


class MLPRuntime(MLModel):
    async def load(self) -> bool:
        self._net = mlp.load(self.settings.parameters.uri, name=self.name)
        return True

    async def predict(self, payload: InferenceRequest) -> InferenceResponse:
        x = NumpyCodec.decode_input(payload.inputs[0]).reshape(-1, mlp.N_IN)
        logits = mlp.predict(self._net, x)
        return InferenceResponse(model_name=self.name, model_version=self.version,
                                 outputs=[NumpyCodec.encode_output("logits", logits)])
