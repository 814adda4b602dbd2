"""Which CUDA device each shared runtime of a GPU worker sees.

A worker that declares ``worker.gpus = N`` gives shared runtime ``i`` the device
``i mod N`` through ``CUDA_VISIBLE_DEVICES``, so that ``worker.shared_runtimes = N``
is one runtime per device on a multi-GPU node, each with a device of its own (CUDA
numbers the one it sees ``cuda:0``). Where the worker's own environment already names
its devices (``CUDA_VISIBLE_DEVICES=2,3``), runtime ``i`` gets the ``i mod N``-th of
those. A CPU worker (``gpus = 0``) leaves the environment as it is; so do isolated
models' own runtimes, which see every device the worker sees.
"""

from __future__ import annotations

from collections.abc import Mapping

from modelfleet.errors import ConfigError

VISIBLE = "CUDA_VISIBLE_DEVICES"


def runtime_device_env(index: int, gpus: int, inherited: Mapping[str, str]) -> dict[str, str]:
    """The environment shared runtime ``index`` adds to pin itself to one device."""
    if gpus <= 0:
        return {}
    named = [d.strip() for d in inherited.get(VISIBLE, "").split(",") if d.strip()]
    if named and len(named) < gpus:
        raise ConfigError(
            f"worker.gpus is {gpus} but {VISIBLE}={inherited[VISIBLE]!r} names "
            f"{len(named)} device(s): give the worker as many devices as it declares")
    devices = named or [str(d) for d in range(gpus)]
    return {VISIBLE: devices[index % gpus]}
