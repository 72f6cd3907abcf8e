"""Megatron-style tensor parallelism for transformers' Llama-family model classes (llama, mistral, qwen2, qwen3): a
loaded model is cut in place into one rank's shard of `world`, the layout of Megatron-LM, vLLM and nano-vllm.

In each decoder layer the attention keeps its rank's heads: q_proj's rows of its query heads and k_proj's / v_proj's
rows of its key/value heads (column parallel: no communication), and o_proj's matching input columns (row parallel),
whose partial outputs one all-reduce sums over the ranks. The MLP keeps its slice of the intermediate size the same
way: gate_proj / up_proj column parallel, down_proj row parallel with one all-reduce. Two all-reduces per layer.

Key/value heads: with at least as many as ranks, each rank keeps KV / N of them; with fewer (2 over 4 ranks, say),
each is replicated on N / KV ranks, as in vLLM: rank r keeps key/value head r * KV // N, the one its H / N query heads
read (query head h reads key/value head h // (H / KV), and a rank's query heads lie in one such group since N divides
by KV). transformers' attention finds its head counts from the projections' widths (`view(*shape, -1, head_dim)`);
`num_key_value_groups` (query heads per key/value head on this rank) is set on each attention module. The config is
set to the rank's counts (heads, key/value heads, intermediate size; head_dim written out), so that what is sized
from it follows the shard: the paged KV cache (engine/runners/torch/kv_cache.kv_shape) holds only this rank's key/value
heads.

The vocabulary is split too (vocab parallel): each rank keeps VocabShard.size rows of the token embedding and of the
LM head, the vocabulary padded to N such shards of a multiple of VOCAB_ALIGN rows (the padding rows are zero). The
embedding looks up the ids in its rows (zero for the others) and one all-reduce sums the ranks' rows; the head
computes its rows' logits, which one gather brings to rank 0 (the rank that samples), the padding cut off. A head
tied to the embedding stays tied to its rows.

Quantized layers (Int8Linear, Int4Linear, Int8Embedding: a GGUF file's own types) are cut from their codes and
scales (loading/sharding/tp_cuts.py), so every rank holds exactly its part of what one process holds.

A rank loads only its shard of a safetensors directory (loading/sharding/tp_loading.py), and under `--quantize
int8|int4` quantizes it there into exactly its part of one process's quantization; of a GGUF file it builds one whole
layer at a time and cuts it at once (`materialize`, loading/gguf/gguf_model.fill_shard). The final norm is replicated.
"""

import dataclasses
from collections.abc import Callable

import torch
import torch.distributed as dist
from transformers import PretrainedConfig

from rbee_worker.errors import ModelLoadError
from rbee_worker.layers.int8_linear import Int8Embedding, Int8Linear
from rbee_worker.loading.loaded import LoadedModel
from rbee_worker.loading.sharding.tp_cuts import CUTS, keep_columns, keep_embedding_rows, keep_rows

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
# A vocabulary shard's rows are a multiple of this (vLLM's padding of the vocabulary): whole blocks of the CPU int4
# kernel's packed rows (32 or 64) for a quantized head.
VOCAB_ALIGN = 64


class RowParallelLinear(torch.nn.Module):
    """A row-parallel linear layer: this rank's input columns of the weight (`linear`, without its bias) applied to
    this rank's slice of the input, the partial outputs summed over the ranks by one all-reduce, the bias added once
    after it. `linear` stays a child of its own kind (nn.Linear, Int8Linear, Int4Linear), so that what the runner
    does to linear layers (oneDNN packing on a CPU) applies to it as to any other."""

    def __init__(
        self, linear: torch.nn.Module, bias: torch.nn.Parameter | None, group: dist.ProcessGroup | None
    ) -> None:
        super().__init__()
        self.linear, self.bias, self.group = linear, bias, group
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        partial = self.linear(x)
        dist.all_reduce(partial, group=self.group)
        return partial if self.bias is None else partial + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features} (this rank's), out_features={self.out_features}"


@dataclasses.dataclass(frozen=True)
class VocabShard:
    """Rank `rank`'s rows of a vocabulary of `vocab` tokens over `world` ranks: `size` rows from `start` (each rank
    as many, a multiple of VOCAB_ALIGN; the last ones past the vocabulary are padding)."""

    vocab: int
    rank: int
    world: int

    @property
    def size(self) -> int:
        """ceil(vocab / world) rounded up to a multiple of VOCAB_ALIGN."""
        rows = -(-self.vocab // self.world)
        return -(-rows // VOCAB_ALIGN) * VOCAB_ALIGN

    @property
    def start(self) -> int:
        return self.rank * self.size


class VocabParallelEmbedding(torch.nn.Module):
    """The token embedding's rows of one vocabulary shard: each id is looked up by the rank that holds its row (zero
    elsewhere), and one all-reduce sums the ranks' rows."""

    def __init__(self, embedding: torch.nn.Module, shard: VocabShard, group: dist.ProcessGroup | None) -> None:
        super().__init__()
        self.embedding, self.shard, self.group = embedding, shard, group
        self.num_embeddings, self.embedding_dim = shard.vocab, embedding.embedding_dim

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.shard.start
        outside = (local < 0) | (local >= self.shard.size)
        rows = self.embedding(local.masked_fill(outside, 0)).masked_fill(outside.unsqueeze(-1), 0)
        dist.all_reduce(rows, group=self.group)
        return rows

    def extra_repr(self) -> str:
        return f"rows {self.shard.start}..{self.shard.start + self.shard.size} of {self.shard.vocab}"


class VocabParallelHead(torch.nn.Module):
    """The LM head's rows of one vocabulary shard: each rank computes its logits, and one gather brings them to rank
    0, which returns the whole vocabulary's (padding cut off); the other ranks return an empty last dimension."""

    def __init__(self, linear: torch.nn.Module, shard: VocabShard, group: dist.ProcessGroup | None) -> None:
        super().__init__()
        self.linear, self.shard, self.group = linear, shard, group
        self.in_features, self.out_features = linear.in_features, shard.vocab

    @property
    def weight(self) -> torch.Tensor:
        """This rank's rows of the head's weight, for what reads a head's `weight` (layers/quantize.py: its device)."""
        return self.linear.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        local = self.linear(x).contiguous()
        if self.shard.rank != 0:
            dist.gather(local, None, dst=0, group=self.group)
            return local[..., :0]
        parts = [torch.empty_like(local) for _ in range(self.shard.world)]
        dist.gather(local, parts, dst=0, group=self.group)
        return torch.cat(parts, dim=-1)[..., : self.shard.vocab]

    def extra_repr(self) -> str:
        return f"rows {self.shard.start}..{self.shard.start + self.shard.size} of {self.shard.vocab}"


def split_sizes(config: PretrainedConfig) -> tuple[int, int, int]:
    """What tensor parallelism splits: (attention heads, key/value heads, intermediate size)."""
    text = config.get_text_config()
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    return heads, kv_heads, text.intermediate_size


def splits(config: PretrainedConfig, world: int) -> list[str]:
    """What keeps the model from splitting over `world` ranks (empty: it splits): attention heads and intermediate
    size must divide by `world`; key/value heads must divide by it, or divide it (each then replicated)."""
    heads, kv_heads, intermediate = split_sizes(config)
    failing = [
        what for what, value in (("attention heads", heads), ("intermediate size", intermediate)) if value % world
    ]
    if kv_heads % world and world % kv_heads:
        failing.insert(1, "key/value heads")
    return failing


def check_divisible(config: PretrainedConfig, world: int, name: str) -> None:
    """Raise ModelLoadError, naming the numbers, when the model cannot split over `world` ranks (`splits`); it
    suggests the rank counts that do."""
    failing = splits(config, world)
    if not failing:
        return
    heads, kv_heads, intermediate = split_sizes(config)
    fits = [n for n in range(2, 65) if not splits(config, n)]
    advice = f"use --tensor-parallel {' or '.join(map(str, fits[:4]))}" if fits else "it cannot be split"
    raise ModelLoadError(
        f"--tensor-parallel {world} cannot split {name}: its {heads} attention heads and intermediate size of "
        f"{intermediate} must each divide by {world}, and its {kv_heads} key/value heads divide by {world} or into "
        f"it; its {' and '.join(failing)} do not; {advice}"
    )


def shard_loaded(loaded: LoadedModel, rank: int, world: int) -> LoadedModel:
    """The loaded model as rank `rank`'s shard of `world`: the torch runtime's loaders build it as that shard, given
    a ModelSpec with that shard (their weight bytes are the shard's); another runtime is refused."""
    if loaded.info.runtime != "torch":
        raise ModelLoadError("tensor parallelism runs on the torch runtime; use --runtime torch (or auto)")
    assert getattr(loaded.model, "tp_shard", None) == (rank, world), "loaded without its ModelSpec.shard"
    return loaded


def shard_model(
    model: torch.nn.Module,
    rank: int,
    world: int,
    name: str = "the model",
    group: dist.ProcessGroup | None = None,
    materialize: Callable[[list[torch.nn.Module]], None] | None = None,
) -> None:
    """Cut `model` (a transformers Llama-family causal LM of float or quantized weights) in place to rank `rank`'s
    shard of `world`; its row-parallel layers, vocabulary-parallel embedding and head communicate over `group` (None:
    the default process group). `materialize(modules)`, where given, is called with each decoder layer just before
    its cut, then with the token embedding and the LM head before theirs: a loader that built the model from
    placeholders fills them in then (loading/gguf/gguf_model.py), so that it holds one whole layer at a time. Raises
    ModelLoadError for a model that cannot be cut: sizes that do not divide (check_divisible), another architecture,
    int4 groups that a row-parallel cut would split."""
    check_divisible(model.config, world, name)
    layers = model.get_decoder().layers
    for layer in layers:
        attention, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        modules = [getattr(attention, n, None) for n in ATTENTION] + [getattr(mlp, n, None) for n in MLP]
        if any(type(module) not in CUTS for module in modules):
            kinds = sorted({type(m).__name__ for m in modules if type(m) not in CUTS})
            raise ModelLoadError(
                f"tensor parallelism cuts Llama-family models (llama, mistral, qwen2, qwen3) in this version; {name} "
                f"has {', '.join(kinds)} layers in place of linear ones (another architecture): load it without "
                "--tensor-parallel"
            )
    heads, kv_heads, intermediate = split_sizes(model.config)
    text = model.config.get_text_config()
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    local_heads, local_inter = heads // world, intermediate // world
    local_kv = max(kv_heads // world, 1)  # fewer key/value heads than ranks: one each, replicated
    first_kv = rank * kv_heads // world  # this rank's first key/value head (the one its query heads read)
    q_width, kv_width = local_heads * head_dim, local_kv * head_dim  # this rank's rows of q_proj, of k_proj and v_proj
    with torch.no_grad():
        for index, layer in enumerate(layers):
            if materialize is not None:
                materialize([layer])
            attention, mlp = layer.self_attn, layer.mlp
            attention.q_proj = keep_rows(attention.q_proj, rank * q_width, q_width)
            attention.k_proj = keep_rows(attention.k_proj, first_kv * head_dim, kv_width)
            attention.v_proj = keep_rows(attention.v_proj, first_kv * head_dim, kv_width)
            attention.o_proj = _row_parallel(
                attention.o_proj, rank * q_width, q_width, group, f"{name}'s layer {index} o_proj"
            )
            attention.num_key_value_groups = local_heads // local_kv
            mlp.gate_proj = keep_rows(mlp.gate_proj, rank * local_inter, local_inter)
            mlp.up_proj = keep_rows(mlp.up_proj, rank * local_inter, local_inter)
            mlp.down_proj = _row_parallel(
                mlp.down_proj, rank * local_inter, local_inter, group, f"{name}'s layer {index} down_proj"
            )
            if hasattr(mlp, "intermediate_size"):
                mlp.intermediate_size = local_inter
        if materialize is not None:
            materialize([model.get_input_embeddings(), model.get_output_embeddings()])
        _split_vocabulary(model, rank, world, name, group)
    model.tp_shard = (rank, world)
    text.head_dim = head_dim  # written out: hidden_size // num_attention_heads no longer gives it
    text.num_attention_heads, text.num_key_value_heads, text.intermediate_size = local_heads, local_kv, local_inter


def _row_parallel(
    linear: torch.nn.Module, start: int, count: int, group: dist.ProcessGroup | None, name: str
) -> RowParallelLinear:
    """Row parallel: the layer's input columns start..start+count, its bias kept apart (added once, after the sum)."""
    bias = None if linear.bias is None else torch.nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
    return RowParallelLinear(keep_columns(linear, start, count, name), bias, group)


def _split_vocabulary(
    model: torch.nn.Module, rank: int, world: int, name: str, group: dist.ProcessGroup | None
) -> None:
    """The token embedding and the LM head cut to this rank's vocabulary shard (see the module docstring); a head tied
    to the embedding (the same float weight, or an int8 head whose codes the embedding reads) shares its rows."""
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    if type(head) not in CUTS or type(embedding) not in (torch.nn.Embedding, Int8Embedding):
        raise ModelLoadError(
            f"tensor parallelism splits the vocabulary of a linear LM head and a token embedding; {name} has a "
            f"{type(head).__name__} head and a {type(embedding).__name__} embedding: load it without --tensor-parallel"
        )
    if head.out_features != embedding.num_embeddings:
        raise ModelLoadError(
            f"{name}'s LM head has {head.out_features} rows and its embedding {embedding.num_embeddings}: tensor "
            "parallelism splits one vocabulary over both; load it without --tensor-parallel"
        )
    shard = VocabShard(head.out_features, rank, world)
    kept_head = keep_rows(head, shard.start, shard.size)
    if type(head) is torch.nn.Linear and head.weight is embedding.weight:
        kept_embedding = torch.nn.Embedding(shard.size, embedding.embedding_dim, device="meta")
        kept_embedding.weight = kept_head.weight
    elif isinstance(head, Int8Linear) and _shares(embedding, head):
        kept_embedding = Int8Embedding(kept_head.codes, kept_head.scales.unsqueeze(1), None, embedding.dtype)
    else:
        kept_embedding = keep_embedding_rows(embedding, shard.start, shard.size)
    model.set_input_embeddings(VocabParallelEmbedding(kept_embedding, shard, group))
    model.set_output_embeddings(VocabParallelHead(kept_head, shard, group))


def _shares(embedding: torch.nn.Module, head: Int8Linear) -> bool:
    """Whether an Int8Embedding reads the int8 head's own codes (a tied GGUF head: see
    gguf_quantized.quantized_embedding)."""
    return isinstance(embedding, Int8Embedding) and embedding.codes.data_ptr() == head.codes.data_ptr()
