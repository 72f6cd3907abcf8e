"""How far a model load has got, for GET /v1/loading/progress: written by the loading thread, read by the server."""

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch.nn.modules.module import register_module_parameter_registration_hook


class LoadCancelled(Exception):
    """The load was called off (the worker is shutting down); raised from inside the loader."""


@dataclass
class LoadProgress:
    """Bytes of weights materialized so far out of the bytes the loader expects; layers follow from that share.

    Plain ints written by one thread and read by another: a reader may see a slightly old value, never a torn one.
    """

    layers_total: int = 0
    bytes_total: int = 0
    bytes_loaded: int = 0
    cancelled: bool = False

    def expect(self, layers: int, weight_bytes: int) -> None:
        self.layers_total, self.bytes_total, self.bytes_loaded = layers, weight_bytes, 0

    def add(self, nbytes: int) -> None:
        """Count a loaded tensor; raises LoadCancelled once `cancel` was called, so a load stops between tensors."""
        self.check()
        self.bytes_loaded += nbytes

    def check(self) -> None:
        """Raise LoadCancelled once `cancel` was called: where a load passes from one stage to the next."""
        if self.cancelled:
            raise LoadCancelled("the model load was cancelled")

    def cancel(self) -> None:
        """Ask the loading thread to stop at its next tensor: a process must not exit while torch runs on it."""
        self.cancelled = True

    @property
    def layers_loaded(self) -> int:
        """Layers' worth of weights loaded so far (weights load layer by layer; the share is exact at both ends)."""
        if self.bytes_total <= 0:
            return 0
        return min(self.layers_total, self.layers_total * self.bytes_loaded // self.bytes_total)

    @contextlib.contextmanager
    def counting_parameters(self) -> Iterator[None]:
        """Count every real (non-meta) parameter that any module registers meanwhile: how transformers'
        from_pretrained installs each loaded weight into the model it first builds on the meta device. A tied
        weight is registered once per module that shares it and counted once."""
        seen: set[int] = set()

        def count(_module: torch.nn.Module, _name: str, parameter: torch.nn.Parameter | None) -> None:
            if parameter is not None and parameter.device.type != "meta" and id(parameter) not in seen:
                seen.add(id(parameter))
                self.add(parameter.nbytes)

        handle = register_module_parameter_registration_hook(count)
        try:
            yield
        finally:
            handle.remove()
