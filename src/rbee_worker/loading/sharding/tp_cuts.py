"""One rank's part of a layer, whatever holds its weights: output rows (a column-parallel layer, or a vocabulary
shard of an embedding or LM head) or input columns (a row-parallel layer) of an nn.Linear, an Int8Linear or an
Int4Linear, and rows of an nn.Embedding or an Int8Embedding. loading/sharding/tp_layers.py decides which part each rank
keeps; this module only cuts.

A quantized layer is cut from its stored codes and scales, so that a rank holds exactly its part of the matrix that
one process holds (the same quantization, not a new one of the part): int8 rows keep their per-row scales, and int8
columns keep the whole row's scale (the row's largest weight may sit on another rank); int4 columns are cut on whole
groups of 32 inputs (a cut inside a group is refused, naming the sizes). An Int4Linear's codes are read back from the
packed layout of the device they are on (PyTorch's CPU layout in blocks of 32 or 64 output rows, the CUDA kernels'
words of 8 inputs); on a CPU whose layout does not unpack for the layer's row count the cut is refused.

Every part is a copy: the whole matrix's storage is freed with the layer it came from. Rows past the source (a
vocabulary padded to whole shards) are zero; nothing reads what they compute. Each part records where it came from
(`Cut`, as its `tp_cut` attribute), so that a rank that loads only its shard (loading/sharding/tp_loading.py) reads
those rows or columns of the stored tensor.
"""

import dataclasses

import torch

from rbee_worker.errors import ModelLoadError
from rbee_worker.layers.int4_linear import Int4Linear, cpu_pack_block, unpack_cpu_int4
from rbee_worker.layers.int8_linear import Int8Embedding, Int8Linear
from rbee_worker.loading.gguf.dequant import INT4_GROUP

CUTS = (torch.nn.Linear, Int8Linear, Int4Linear)  # the linear layers this module cuts


@dataclasses.dataclass(frozen=True)
class Cut:
    """Where a part's weight comes from: `count` rows (dim 0) or columns (dim 1) of the whole from `start`; a bias
    follows a cut of rows and is absent from a cut of columns."""

    dim: int
    start: int
    count: int


def marked(module: torch.nn.Module, cut: Cut) -> torch.nn.Module:
    module.tp_cut = cut
    return module


def rows(tensor: torch.Tensor | None, start: int, count: int) -> torch.Tensor | None:
    """Rows start..start+count of `tensor` as a new tensor, zero rows past its end."""
    if tensor is None:
        return None
    part = tensor[start : start + count]
    if len(part) == count:
        return part.clone()
    padded = torch.zeros((count, *tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device)
    padded[: len(part)] = part
    return padded


def keep_rows(layer: torch.nn.Module, start: int, count: int) -> torch.nn.Module:
    """The layer with only output rows start..start+count (and their bias): column parallel."""
    return marked(_rows_of(layer, start, count), Cut(0, start, count))


def _rows_of(layer: torch.nn.Module, start: int, count: int) -> torch.nn.Module:
    if type(layer) is torch.nn.Linear:
        return _linear(rows(layer.weight.detach(), start, count), rows(_data(layer.bias), start, count))
    if isinstance(layer, Int8Linear):
        codes, scales = rows(layer.codes, start, count), rows(layer.scales, start, count)
        return Int8Linear(codes, scales, _keep(layer.bias, start, count))
    if isinstance(layer, Int4Linear):
        codes, scales, zeros = int4_parts(layer)
        bias = _keep(layer.bias, start, count)
        return Int4Linear(rows(codes, start, count), rows(scales, start, count), rows(zeros, start, count), bias)
    raise TypeError(f"cannot cut {type(layer).__name__}")


def keep_columns(layer: torch.nn.Module, start: int, count: int, name: str) -> torch.nn.Module:
    """The layer with only input columns start..start+count and no bias (a row-parallel layer adds its bias once,
    after the sum); `name` (the layer's place in the model) for the error of an int4 cut inside a group."""
    return marked(_columns_of(layer, start, count, name), Cut(1, start, count))


def _columns_of(layer: torch.nn.Module, start: int, count: int, name: str) -> torch.nn.Module:
    columns = slice(start, start + count)
    if type(layer) is torch.nn.Linear:
        return _linear(layer.weight.detach()[:, columns].clone(), None)
    if isinstance(layer, Int8Linear):
        return Int8Linear(layer.codes[:, columns].clone(), layer.scales.clone(), None)
    if isinstance(layer, Int4Linear):
        check_groups(layer.in_features, start, count, name)
        codes, scales, zeros = int4_parts(layer)
        groups = slice(start // INT4_GROUP, (start + count) // INT4_GROUP)
        return Int4Linear(codes[:, columns].clone(), scales[:, groups].clone(), zeros[:, groups].clone(), None)
    raise TypeError(f"cannot cut {type(layer).__name__}")


def check_groups(in_features: int, start: int, count: int, name: str) -> None:
    """Raise ModelLoadError, naming the sizes, where int4 columns start..start+count cut a group of 32 inputs."""
    if start % INT4_GROUP or count % INT4_GROUP:
        raise ModelLoadError(
            f"{name} is int4 in groups of {INT4_GROUP} inputs, and its {in_features} inputs split into parts of "
            f"{count}, which cut its groups: use a --tensor-parallel that leaves each rank a multiple of {INT4_GROUP} "
            "inputs, or --quantize int8"
        )


def keep_embedding_rows(embedding: torch.nn.Module, start: int, count: int) -> torch.nn.Module:
    """The token embedding with only rows start..start+count (a vocabulary shard)."""
    return marked(_embedding_rows_of(embedding, start, count), Cut(0, start, count))


def _embedding_rows_of(embedding: torch.nn.Module, start: int, count: int) -> torch.nn.Module:
    if type(embedding) is torch.nn.Embedding:
        kept = torch.nn.Embedding(count, embedding.embedding_dim, device="meta")
        kept.weight = torch.nn.Parameter(rows(embedding.weight.detach(), start, count), requires_grad=False)
        return kept
    if isinstance(embedding, Int8Embedding):
        codes, scales = rows(embedding.codes, start, count), rows(embedding.scales, start, count)
        return Int8Embedding(codes, scales, rows(embedding.zeros, start, count), embedding.dtype)
    raise TypeError(f"cannot cut {type(embedding).__name__}")


def int4_parts(layer: Int4Linear) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """An Int4Linear's codes [out, in] (0..15), scales and zeros [out, in / 32] (bfloat16, as the layer holds them),
    read back from its packed layout."""
    out_features, in_features = layer.out_features, layer.in_features
    scales, zeros = (part.T for part in layer.scales_and_zeros.unbind(-1))
    packed = layer.packed
    if packed.device.type == "cuda":  # words [in / 8, out] int32, code j of word w = input 8w + j
        shifts = torch.arange(0, 32, 4, device=packed.device, dtype=torch.int32)
        codes = (packed[:, None, :] >> shifts[None, :, None]) & 15
        return codes.reshape(in_features, out_features).T.contiguous(), scales, zeros
    block = cpu_pack_block()
    if block is None or out_features % block:
        raise ModelLoadError(
            f"an int4 layer of {out_features} output rows cannot be read back from this CPU's packed layout "
            f"(blocks of {block} rows), so it cannot be cut: load the model with --quantize int8 or none"
        )
    return unpack_cpu_int4(packed, out_features, in_features, block), scales, zeros


def _linear(weight: torch.Tensor, bias: torch.Tensor | None) -> torch.nn.Linear:
    """An nn.Linear of these tensors (made on the meta device: nothing initialized only to be replaced)."""
    linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    linear.weight = torch.nn.Parameter(weight, requires_grad=False)
    if bias is not None:
        linear.bias = torch.nn.Parameter(bias, requires_grad=False)
    return linear


def _data(bias: torch.Tensor | None) -> torch.Tensor | None:
    return None if bias is None else bias.detach()


def _keep(bias: torch.Tensor | None, start: int, count: int) -> torch.Tensor | None:
    """A quantized layer's bias rows, as the same kind of tensor (a parameter stays one)."""
    part = rows(_data(bias), start, count)
    return torch.nn.Parameter(part, requires_grad=False) if isinstance(bias, torch.nn.Parameter) else part
