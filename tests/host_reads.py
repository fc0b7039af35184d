"""What a block of code reads from a device to the host: the tests' way to prove a training step reads nothing off
the device while the device still computes it (``float()`` of a loss waits for the device)."""

from __future__ import annotations

from typing import Any

from torch.utils._python_dispatch import TorchDispatchMode


class HostReads(TorchDispatchMode):
    """The tensors whose values are read to the host (``aten._local_scalar_dense``: ``.item()``, ``float()``,
    ``bool()``), by their data pointers, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.read: list[int] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func.overloadpacket.__name__ == "_local_scalar_dense":
            self.read.append(args[0].data_ptr())
        return func(*args, **(kwargs or {}))
