"""The KV cache: one pool of fixed-size blocks per layer, allocated once after the weights, and each batch row's block
table, given to transformers' own model classes as their cache.

Each layer holds keys and values as `[blocks, block_size, kv_heads, head_dim]` (vLLM's layout), so position p of the
request in batch row r is `tables[r, p // block_size]`'s entry `p % block_size`, and a block's rows are contiguous.
Which blocks a request holds is the scheduler's business (engine/kv_blocks.py); the runner copies each row's table
here before a forward that reads it. Before a forward the runner also says where the new tokens go (flat positions:
block * block_size + offset; block 0 is the scratch block that padding writes to) and how attention reads the cache:

- `gather`: the rows' positions [0, kv_len) copied out through their tables, as `[rows, kv_heads, kv_len, head_dim]`,
  with the engine's 4-D mask saying which each query sees (prompt chunks after cached tokens; decode steps off CUDA);
- `new`: the forward's own new keys and values (a first prompt chunk of one request: nothing cached comes before it);
- `paged`: the pool itself, read by the paged decode kernel through the tables that the forward's `kv_block_tables`
  and `kv_lengths` arguments carry (decode steps on CUDA, inside their graphs).

Memory is zeroed before it is first read, so that masked positions in a gathered copy hold finite values (zero, or an
earlier request's), never the NaN that uninitialized memory could hold and that a zero attention weight would not
cancel: on a GPU at once, on a CPU block by block as blocks are first used, so that only the part in use becomes
resident.
"""

import importlib.util
from collections.abc import Sequence
from typing import Literal

import torch
from transformers import PretrainedConfig

from rbee_worker.engine.kv_blocks import SCRATCH_BLOCK
from rbee_worker.engine.runner import KvGeometry

if importlib.util.find_spec("triton") is not None:  # CUDA builds of PyTorch
    from rbee_worker.engine import kv_write
else:
    kv_write = None

ReadMode = Literal["gather", "new", "paged"]


def kv_bytes_per_token(config: PretrainedConfig, dtype: torch.dtype) -> int:
    """Bytes of keys and values that one token of context takes over all layers."""
    heads, key_dim, value_dim = kv_shape(config)
    return config.get_text_config().num_hidden_layers * heads * (key_dim + value_dim) * dtype.itemsize


def kv_shape(config: PretrainedConfig) -> tuple[int, int, int]:
    """The heads of what a layer gives its cache and the widths of a head's key and value, as transformers' attention
    layers hand them over: a multi-query config (Falcon's and GPTBigCode's `multi_query`, without Falcon's
    `new_decoder_architecture`) has one key/value head; latent attention (DeepSeek-V2 / V3, Kimi, MiniCPM3:
    `kv_lora_rank`) caches its compressed latent (`kv_lora_rank` wide) and the rotary part of its keys
    (`qk_rope_head_dim`) as one head of keys and values, which its layers expand after reading them."""
    text = config.get_text_config()
    if caches_latent(config):
        return 1, text.kv_lora_rank, text.qk_rope_head_dim
    heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    if getattr(text, "multi_query", False) and not getattr(text, "new_decoder_architecture", False):
        heads = 1
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    return heads, head_dim, head_dim


def caches_latent(config: PretrainedConfig) -> bool:
    """Whether the model's layers cache a compressed latent (latent attention: `kv_lora_rank`; see kv_shape)."""
    return getattr(config.get_text_config(), "kv_lora_rank", None) is not None


class PagedCache:
    """Duck-typed as a transformers Cache (only `update` and `get_seq_length` are called with a 4-D mask given)."""

    def __init__(
        self, config: PretrainedConfig, kv: KvGeometry, rows: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        self.heads, self.key_dim, self.value_dim = kv_shape(config)
        layers = config.get_text_config().num_hidden_layers
        self.block_size, self.blocks = kv.block_size, kv.blocks
        allocate = torch.zeros if device.type == "cuda" else torch.empty
        key_shape, value_shape = ((kv.blocks, kv.block_size, self.heads, d) for d in (self.key_dim, self.value_dim))
        self.keys = [allocate(key_shape, dtype=dtype, device=device) for _ in range(layers)]
        self.values = [allocate(value_shape, dtype=dtype, device=device) for _ in range(layers)]
        self.bytes_per_block = kv.block_size * kv.bytes_per_token
        self._zeroed = kv.blocks if device.type == "cuda" else 0  # blocks [0, _zeroed) are initialized
        self.ensure_zeroed(SCRATCH_BLOCK)
        # Each batch row's block table (row `rows`: the scratch row of padding), long for indexing; its last column
        # stays the scratch block, which a gathered read may take past a row's blocks (see `prepare`).
        self.max_blocks = -(-kv.context // kv.block_size)
        self.tables = torch.zeros(rows + 1, self.max_blocks + 1, dtype=torch.long, device=device)
        self.device = device
        # On CUDA one kernel writes a forward's new keys and values (engine/kv_write.py); elsewhere two index writes.
        self._one_write = (
            device.type == "cuda" and kv_write is not None and self.key_dim == self.value_dim
            and kv_write.supported(self.key_dim)
        )  # fmt: skip
        self._kv_len = 0
        self._mode: ReadMode = "gather"
        self._writes: torch.Tensor | None = None  # flat positions of the forward's new tokens, in row-major order
        self._reads: torch.Tensor | None = None  # gather: the rows' first blocks, covering kv_len, row after row

    @property
    def resident_bytes(self) -> int:
        """Bytes of the pool that have been touched (the rest may not be backed by memory yet)."""
        return self._zeroed * self.bytes_per_block

    def ensure_zeroed(self, block: int) -> None:
        """Blocks up to `block` are initialized (the pool hands out blocks in id order until it first reuses one)."""
        if block >= self._zeroed:
            for layer in (*self.keys, *self.values):
                layer[self._zeroed : block + 1].zero_()
            self._zeroed = block + 1

    def set_table(self, row: int, blocks: Sequence[int]) -> None:
        """Batch row `row`'s block table (the blocks of its request, in position order)."""
        self.ensure_zeroed(max(blocks, default=SCRATCH_BLOCK))
        self.tables[row, : len(blocks)] = torch.tensor(blocks, dtype=torch.long)

    def flat_positions(self, rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Flat pool positions of `positions` (rows, n) of batch rows `rows` (rows,); a position below 0 (padding) is
        the scratch block's first entry."""
        index = positions.clamp(min=0)
        blocks = self.tables[rows[:, None], index // self.block_size]
        return torch.where(positions >= 0, blocks * self.block_size + index % self.block_size, 0)

    def prepare(self, rows: torch.Tensor, positions: torch.Tensor, kv_len: int, mode: ReadMode) -> None:
        """Set up the next forward: batch row b is the request of batch row rows[b] and feeds its new tokens at
        positions[b] (shape (rows, new tokens); -1: padding); attention reads as `mode` says, in gather mode
        positions [0, kv_len) of each row."""
        self._kv_len, self._mode = kv_len, mode
        self._writes = self.flat_positions(rows, positions).reshape(-1)
        if mode == "gather":  # whole blocks: one contiguous copy of each, not one of each position
            # Always more positions than kv_len, and at least two blocks: under torch.compile a read of exactly kv_len
            # positions, or of one block, is a class of shapes of its own, which would compile again after ready.
            blocks = max(2, kv_len // self.block_size + 1)
            self._reads = self.tables[rows, :blocks].reshape(-1)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        if key_states.shape[1::2] != keys.shape[2:] or value_states.shape[1::2] != values.shape[2:]:
            raise ValueError(
                f"layer {layer_idx} caches keys of {tuple(key_states.shape[1::2])} and values of "
                f"{tuple(value_states.shape[1::2])} (heads, width), not the {tuple(keys.shape[2:])} and "
                f"{tuple(values.shape[2:])} that its config gives (kv_cache.kv_shape)"
            )
        flat_keys = keys.view(-1, self.heads, self.key_dim)
        flat_values = values.view(-1, self.heads, self.value_dim)
        if self._one_write:
            kv_write.write_kv(key_states, value_states, flat_keys, flat_values, self._writes)
        else:
            flat_keys[self._writes] = key_states.transpose(1, 2).reshape(-1, self.heads, self.key_dim)
            flat_values[self._writes] = value_states.transpose(1, 2).reshape(-1, self.heads, self.value_dim)
        if self._mode == "new":
            return key_states, value_states
        if self._mode == "paged":
            return keys, values
        return self._gather(keys, key_states.shape[0]), self._gather(values, key_states.shape[0])

    def _gather(self, pool: torch.Tensor, rows: int) -> torch.Tensor:
        """Positions [0, kv_len) of each row, from its blocks: (rows, kv_heads, kv_len, head_dim)."""
        blocks = pool.index_select(0, self._reads).view(rows, -1, self.heads, pool.shape[-1])
        return blocks[:, : self._kv_len].transpose(1, 2)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._kv_len


def decode_mask(lengths: torch.Tensor, kv_len: int, dtype: torch.dtype) -> torch.Tensor:
    """(rows, 1, 1, kv_len) additive mask: row b sees positions [0, lengths[b]); a row of length 0 (a dummy row) sees
    position 0 only, so that its softmax stays finite."""
    visible = torch.arange(kv_len, device=lengths.device)[None, :] < lengths.clamp(min=1)[:, None]
    return _additive(visible, dtype)[:, None, None, :]


def prefill_mask(
    starts: Sequence[int], counts: Sequence[int], kv_len: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """(rows, 1, width, kv_len) causal mask for prompt chunks of several sequences in one forward: row b holds
    counts[b] new tokens after starts[b] cached ones, left-padded to the longest chunk (width), so that every row's
    last column is its last new token. A padding query sees position 0 only, so that its softmax stays finite."""
    width = max(counts)
    pad = torch.tensor([width - count for count in counts], device=device)[:, None]
    column = torch.arange(width, device=device)[None, :]
    query = torch.tensor(starts, device=device)[:, None] + column - pad  # each query's position in its sequence
    real = (column >= pad)[:, :, None]
    keys = torch.arange(kv_len, device=device)[None, None, :]
    visible = torch.where(real, keys <= query[:, :, None], keys == 0)
    return _additive(visible, dtype)[:, None]


def _additive(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    zero = torch.zeros((), dtype=dtype, device=visible.device)
    return torch.where(visible, zero, torch.finfo(dtype).min)
