"""Projections that read the same input, computed as one matrix product: a layer's q/k/v and its MLP's gate/up (the
merged layers vLLM loads). One product over the stacked matrix reads the same bytes as the separate ones in fewer,
larger kernels, which take less time in bfloat16, int4 and int8 alike (bench/weight_only_kernels.py --merged;
bench/results/README.md).

transformers' model classes stay as they are: each projection becomes a ProjectionSlice of one SharedProduct. The
first slice called with an input computes the whole product, the others called with that same tensor (as the
attention and MLP forwards do) take their columns of it, and the last of them drops the references. A slice called
with any other input computes the product again, so the result is right whatever the call order; only the saving
depends on it.
"""

import itertools

import torch

from rbee_worker.layers.int4_linear import Int4Linear
from rbee_worker.layers.int8_linear import Int8Linear

GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class _Latest:
    """The latest input of a SharedProduct, its product, and how many readers have yet to take it. A plain object:
    these change 15 times per layer in every step, and nn.Module's __setattr__ looks each name up in its parameters,
    buffers and submodules first, a visible share of a small model's CPU decode step (bench/results/README.md)."""

    __slots__ = ("input", "output", "unread")

    def __init__(self) -> None:
        self.input: torch.Tensor | None = None
        self.output: torch.Tensor | None = None
        self.unread = 0


class SharedProduct(torch.nn.Module):
    def __init__(self, layer: torch.nn.Module, readers: int) -> None:
        super().__init__()
        self.layer, self.readers = layer, readers
        self._latest = _Latest()

    def read(self, x: torch.Tensor) -> torch.Tensor:
        latest = self._latest
        if x is not latest.input or latest.unread == 0:
            latest.input, latest.output, latest.unread = x, self.layer(x), self.readers
        output = latest.output
        latest.unread -= 1
        if latest.unread == 0:  # every reader has it: keep no activations alive between forwards
            latest.input = latest.output = None
        return output


class ProjectionSlice(torch.nn.Module):
    """Output columns start..stop of a SharedProduct, in place of the linear layer they came from.

    The bounds are the shape of an empty buffer (`columns`: [start, 0, width]), not int attributes: where compiled.py
    makes the modules' ints dynamic (the CUDA decoder layers), int bounds would be symbolic, and inductor then copies
    the product of two slices (the MLP's silu(gate) * up) once more before the next matrix product, a kernel more in
    every layer of every step. The shapes of buffers stay static."""

    def __init__(self, product: SharedProduct, start: int, stop: int) -> None:
        super().__init__()
        self.product = product
        self.in_features, self.out_features = product.layer.in_features, stop - start
        device = next(itertools.chain(product.layer.parameters(), product.layer.buffers())).device
        self.register_buffer("columns", torch.empty(start, 0, stop - start, device=device), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        start, _, width = self.columns.shape
        return self.product.read(x)[..., start : start + width]


def merge_projections(model: torch.nn.Module) -> int:
    """Merge every group of GROUPS found in a module of `model` whose layers can be stacked; how many were merged."""
    merged = 0
    for parent in list(model.modules()):
        for names in GROUPS:
            layers = [getattr(parent, name, None) for name in names]
            if any(layer is None for layer in layers) or (stacked := stack(layers)) is None:
                continue
            product = SharedProduct(stacked, len(layers))
            start = 0
            for name, layer in zip(names, layers, strict=True):
                setattr(parent, name, ProjectionSlice(product, start, start + layer.out_features))
                start += layer.out_features
            merged += 1
    return merged


def stack(layers: list[torch.nn.Module]) -> torch.nn.Module | None:
    """One layer whose output is the layers' outputs side by side, or None where they cannot be stacked (different
    kinds or input sizes, biases on some only, int4 rows not in whole tiles)."""
    kind = type(layers[0])
    if any(type(layer) is not kind for layer in layers) or len({layer.in_features for layer in layers}) != 1:
        return None
    if len({layer.bias is None for layer in layers}) != 1:
        return None
    bias = None if layers[0].bias is None else torch.cat([layer.bias.detach() for layer in layers])
    if kind is torch.nn.Linear:
        # Built on the meta device and given the stacked tensors: no initialization of a matrix about to be replaced.
        linear = torch.nn.Linear(layers[0].in_features, sum(layer.out_features for layer in layers), device="meta")
        grad = layers[0].weight.requires_grad
        linear.weight = torch.nn.Parameter(torch.cat([layer.weight.detach() for layer in layers]), requires_grad=grad)
        linear.bias = None if bias is None else torch.nn.Parameter(bias, requires_grad=grad)
        return linear
    if kind in (Int8Linear, Int4Linear):
        return kind.stacked(layers, bias)
    return None
