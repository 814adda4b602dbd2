"""``TorchModel``: a model whose weights are torch modules, movable between memory tiers.

The runtime's cache demotes a model from the device to host memory when it needs
room and the host budget allows; promoting it back is then a copy, not a reload.
For a ``TorchModel`` the copy is real: ``to_host`` moves every module to the CPU into
pinned (page-locked) memory, so that ``to_device`` can copy it back at the full
host-to-device bandwidth. Subclasses write ``load`` as usual, putting their modules on
``self.device`` (``ctx.device`` is "cuda" when the manifest asks for it and a GPU
is present, "cpu" otherwise)::

    class Classifier(TorchModel):
        def load(self, ctx):
            super().load(ctx)
            self.net = torch.jit.load(ctx.artifact("model.pt"), map_location=self.device)

Weights saved as safetensors load without a copy through ``load_tensors``: on the CPU
the tensors map the file (its pages are the page cache's, shared between runtimes);
on a GPU they go from the file straight to the device, with no host copy in a pickle
in between (``torch.load`` unpickles into host memory first)::

    def load(self, ctx):
        super().load(ctx)
        self.net = Net().to(self.device)
        self.net.load_state_dict(self.load_tensors(ctx, "model.safetensors"), assign=True)

torch is imported only when a TorchModel is used.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from modelfleet.errors import ModelLoadFailed
from modelfleet.model.api import Context, Model


class TorchModel(Model):
    device: str = "cpu"

    def load(self, ctx: Context) -> None:
        self.device = ctx.device

    def load_tensors(self, ctx: Context, name: str) -> dict[str, Any]:
        """The safetensors artifact ``name`` as torch tensors on ``self.device``
        (``safetensors.torch.load_file``): mapped on the CPU, straight to a GPU.

        An isolated model (``[isolation]`` requirements) lists ``safetensors`` among its
        requirements, as it lists torch."""
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        path = ctx.artifact(name)
        if not path.is_file():
            raise ModelLoadFailed(f"artifact {path} does not exist")
        try:
            return load_file(path, device=self.device)
        except (SafetensorError, OSError) as exc:
            raise ModelLoadFailed(f"artifact {path} is not a readable safetensors "
                                  f"file: {exc}") from exc

    def modules(self) -> Iterator[Any]:
        """The torch modules holding this model's weights: every ``nn.Module`` attribute."""
        import torch

        for value in vars(self).values():
            if isinstance(value, torch.nn.Module):
                yield value

    def to_host(self) -> None:
        """Demote: weights to host memory (pinned when a GPU is there to copy them back)."""
        import torch

        pin = torch.cuda.is_available()
        for module in self.modules():
            module.to("cpu")
            if pin:
                for tensor in [*module.parameters(), *module.buffers()]:
                    tensor.data = tensor.data.pin_memory()

    def to_device(self) -> None:
        """Promote: weights back onto ``self.device`` (a copy, not a reload)."""
        import torch

        for module in self.modules():
            module.to(self.device, non_blocking=True)
        if self.device.startswith("cuda"):
            torch.cuda.synchronize()
