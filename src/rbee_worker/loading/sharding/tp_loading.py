"""A tensor-parallel rank that loads only its shard of a safetensors directory, so that no process ever holds the
whole model (a 70B over 4 GPUs: a quarter each, plus the replicated norms).

A rank's ModelSpec names its shard (ModelSpec.shard), which both loaders take: loading/gguf/gguf_model.py builds a GGUF
file's shard one whole layer at a time (gguf_model.fill_shard), and loading/hf.py, given a shard, loads a directory
through `load_shard_weights`: transformers builds the model from placeholders (one zero expanded to each stored tensor's
shape: no memory, while its buffers, the rotary frequencies say, are made as in any load), its parameters go to the meta
device (so that cutting them allocates nothing), tp_layers.shard_model cuts it (each cut part records its `Cut`:
loading/sharding/tp_cuts.py), and each parameter is then read from its file as the rows or columns its part holds
(safetensors' `get_slice`, one tensor at a time), a tied weight once. So a rank's memory peaks at its shard plus about
twice its largest part (the part and the file's pages it was read from). The model comes back already cut (`tp_shard`
set: tp_layers.shard_loaded checks it).

Quantization: a rank quantizes its shard at load as one process quantizes the whole model (loading/hf.py,
layers/quantize.py), and holds exactly that quantization's cut. `--quantize int4`'s groups run along a row's inputs,
so a cut of rows keeps them whole and a cut of columns on whole groups of 32 too (a cut inside a group is refused):
the float shard is quantized. `--quantize int8`'s one scale per row needs the whole rows of the row-parallel layers
(o_proj, down_proj), whose input columns the ranks split: each of those matrices is read whole, one at a time,
quantized, and cut to the rank's columns (`int8_columns`), so that the peak also holds one such matrix and the
temporaries of its quantization (as one process's quantization of it does); the other layers' rows quantize alone,
one scale each. An untied LM head, which one process on CUDA quantizes to int8 per row, is quantized as the rank's
vocabulary shard of it (layers/quantize.quantize_head): the same rows.
"""

from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import PretrainedConfig

from rbee_worker.layers.quantize import int8_linear
from rbee_worker.loading.gguf.dequant import INT4_GROUP
from rbee_worker.loading.progress import LoadProgress
from rbee_worker.loading.sharding.tp_cuts import Cut, check_groups, keep_columns, rows
from rbee_worker.loading.sharding.tp_layers import (
    RowParallelLinear,
    VocabParallelEmbedding,
    VocabParallelHead,
    shard_model,
)
from rbee_worker.loading.spec import Shard


def load_shard_weights(
    path: Path,
    model_class: type,
    config: PretrainedConfig,
    files: list[Path],
    dtype: torch.dtype,
    device: torch.device,
    shard: Shard,
    quantize: str,
    progress: LoadProgress,
) -> tuple[torch.nn.Module, dict]:
    """The model of a directory's safetensors `files`, cut to `shard` with only its part of each tensor read, on
    `device` in `dtype`; and transformers' loading info of the placeholders (for hf.check_loading_info)."""
    where: dict[str, Path] = {}  # stored tensor -> its file
    placeholders: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(file, framework="pt") as handle:
            for key in handle.keys():  # noqa: SIM118
                where[key] = file
                placeholders[key] = torch.zeros((), dtype=dtype).expand(handle.get_slice(key).get_shape())
    model, loading_info = model_class.from_pretrained(
        None, config=config, state_dict=placeholders, dtype=dtype, output_loading_info=True
    )
    to_meta(model)  # so that the cut allocates nothing
    shard_model(model, shard.rank, shard.world, path.name)
    if quantize == "int4":
        check_int4_groups(model, shard.world, path.name)
    # Under int8, each row-parallel layer by its inner linear layer: `int8_columns` reads its part (see the module).
    int8_wrappers = (
        {id(module.linear): module for module in model.modules() if isinstance(module, RowParallelLinear)}
        if quantize == "int8"
        else {}
    )
    for keys, places, cut in parameters(model):
        key = next((key for key in keys if key in where), None)
        if key is None:
            continue  # reported by check_loading_info (a tensor the file lacks)
        # The file is opened for each tensor, and the tensor copied: safetensors' tensors are views of the file's
        # mapping, whose pages that were read count as this process's memory as long as it stays mapped.
        with safe_open(where[key], framework="pt") as handle:
            if (wrapper := int8_wrappers.get(id(places[0][0]))) is not None and cut is not None:
                wrapper.linear = int8_columns(handle, key, cut, device, dtype)
                progress.add(cut.count * wrapper.out_features * dtype.itemsize)
                continue
            part = read(handle, key, cut).to(device, dtype, copy=True)
        parameter = torch.nn.Parameter(part, requires_grad=False)
        for module, name in places:
            setattr(module, name, parameter)
        progress.add(part.nbytes)
    return model, loading_info


def to_meta(model: torch.nn.Module) -> None:
    """Every parameter of `model` on the meta device (a tied one stays tied); its buffers stay as they are."""
    for _, places, _ in parameters(model):
        module, name = places[0]
        parameter = torch.nn.Parameter(getattr(module, name).to("meta"), requires_grad=False)
        for module, name in places:
            setattr(module, name, parameter)


def parameters(
    model: torch.nn.Module,
) -> Iterator[tuple[list[str], list[tuple[torch.nn.Module, str]], Cut | None]]:
    """Each parameter of a cut model, once: the names of the stored tensor it comes from (one per place: a tied
    weight is stored under one of them), every (module, attribute) that holds it, and the part of the stored tensor
    it holds (None: all of it)."""
    modules = dict(model.named_modules())
    wrappers = (RowParallelLinear, VocabParallelHead, VocabParallelEmbedding)
    # A wrapper's inner layer stands for the wrapper's place in the uncut model (o_proj.linear -> o_proj).
    stored = {
        f"{name}.{child}": name
        for name, module in modules.items()
        if isinstance(module, wrappers)
        for child in ("linear", "embedding")
    }
    holders: dict[int, list[tuple[str, torch.nn.Module, str]]] = {}
    for module_name, module in modules.items():
        for name, parameter in module.named_parameters(recurse=False):
            holders.setdefault(id(parameter), []).append((module_name, module, name))
    for places in holders.values():
        keys = [f"{stored.get(module_name, module_name)}.{name}" for module_name, _, name in places]
        cut = next((module.tp_cut for _, module, _ in places if hasattr(module, "tp_cut")), None)
        yield keys, [(module, name) for _, module, name in places], cut


def read(handle, key: str, cut: Cut | None) -> torch.Tensor:
    """The part `cut` of stored tensor `key` (None: all of it), reading only that part of the file (a view of the
    file's mapping, but for padded rows)."""
    stored = handle.get_slice(key)
    if cut is None:
        return stored[:]
    shape = stored.get_shape()
    if cut.dim == 1 and len(shape) == 2:
        return stored[:, cut.start : cut.start + cut.count]
    part = stored[cut.start : min(cut.start + cut.count, shape[0])]
    # Rows past the tensor's end (a vocabulary padded to whole shards) are zero.
    return part if len(part) == cut.count else rows(part, 0, cut.count)


def int8_columns(handle, key: str, cut: Cut, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """The columns `cut` of stored matrix `key` as int8, exactly the whole matrix's quantization cut: the whole
    matrix is read in `dtype` on `device` (as one process loads it), quantized with one scale per whole row, then
    cut (tp_cuts.keep_columns)."""
    whole = handle.get_slice(key)[:].to(device, dtype)
    return keep_columns(int8_linear(whole, None), cut.start, cut.count, key)


def check_int4_groups(model: torch.nn.Module, world: int, name: str) -> None:
    """Under --quantize int4: refuse a row-parallel layer whose whole inputs form groups of 32 and whose part on this
    rank cuts them (one process would quantize it, and its parts cannot be the same)."""
    for module_name, module in model.named_modules():
        if isinstance(module, RowParallelLinear) and (module.in_features * world) % INT4_GROUP == 0:
            cut = module.linear.tp_cut
            check_groups(module.in_features * world, cut.start, cut.count, f"{name}'s {module_name}")
