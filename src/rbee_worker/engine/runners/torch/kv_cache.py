"""The KV cache: one pool of fixed-size blocks per layer, allocated once after the weights, and each batch row's block
table, given to transformers' own model classes as their cache.

Each layer holds keys and values as `[blocks, block_size, kv_heads, head_dim]` (vLLM's layout), so position p of the
request in batch row r is `tables[r, p // block_size]`'s entry `p % block_size`, and a block's rows are contiguous.
Which blocks a request holds is the scheduler's business (engine/scheduling/kv_blocks.py); the runner copies each row's
table here before a forward that reads it. Before a forward the runner also says where the new tokens go (flat
positions: block * block_size + offset; block 0 is the scratch block that padding writes to) and how attention reads the
cache:

- `gather`: the rows' positions [0, kv_len) copied out through their tables, as `[rows, kv_heads, kv_len, head_dim]`,
  with the engine's 4-D mask saying which each query sees (prompt chunks after cached tokens; decode steps off CUDA);
- `new`: the forward's own new keys and values (a first prompt chunk of one request: nothing cached comes before it);
- `paged`: the pool itself, read by the paged decode kernel through the tables that the forward's `kv_block_tables`
  and `kv_lengths` arguments carry (decode steps on CUDA, inside their graphs).

A model with sliding layers may keep those layers' keys and values in a pool of their own (KvGeometry.window_blocks),
where a request holds the blocks of its last positions only: its table there has the scratch block for the positions
before its window. Attention in a sliding layer reads no position before the window (the paged kernel skips those
blocks; a gathered copy masks what it copies from the scratch block there).

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

from rbee_worker.engine.runners.protocol import KvGeometry
from rbee_worker.engine.runners.torch.attention import config_window
from rbee_worker.engine.scheduling.kv_blocks import SCRATCH_BLOCK

if importlib.util.find_spec("triton") is not None:  # CUDA builds of PyTorch
    from rbee_worker.kernels import kv_write
else:
    kv_write = None

ReadMode = Literal["gather", "new", "paged"]


def kv_bytes_per_token(config: PretrainedConfig, dtype: torch.dtype, layers: int | None = None) -> int:
    """Bytes of keys and values that one token of context takes over all layers (or `layers` of them)."""
    heads, key_dim, value_dim = kv_shape(config)
    layers = config.get_text_config().num_hidden_layers if layers is None else layers
    return layers * heads * (key_dim + value_dim) * dtype.itemsize


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


def sliding_layers(config: PretrainedConfig) -> tuple[int | None, frozenset[int]]:
    """The model's sliding window (the positions a sliding layer's query sees, itself included) and the layers that
    slide, as transformers' masks decide them: those whose `layer_types` entry is "sliding_attention", or every layer
    of a model with a window whose config names no layer types (Mistral, Mixtral); (None, {}) without a window."""
    text = config.get_text_config()
    window = config_window(config)
    if window is None:
        return None, frozenset()
    types = getattr(text, "layer_types", None)
    if types is None:
        return window, frozenset(range(text.num_hidden_layers))
    return window, frozenset(i for i, kind in enumerate(types) if kind == "sliding_attention")


def caches_latent(config: PretrainedConfig) -> bool:
    """Whether the model's layers cache a compressed latent (latent attention: `kv_lora_rank`; see kv_shape)."""
    return getattr(config.get_text_config(), "kv_lora_rank", None) is not None


class _Pool:
    """The keys and values of some layers in blocks of one pool, each batch row's block table into it, and where the
    next forward writes and reads them."""

    def __init__(
        self, layers: list[int], blocks: int, block_size: int, max_blocks: int, shape: tuple[int, int, int],
        rows: int, dtype: torch.dtype, device: torch.device,
    ) -> None:  # fmt: skip
        heads, key_dim, value_dim = shape
        allocate = torch.zeros if device.type == "cuda" else torch.empty
        self.blocks, self.block_size = blocks, block_size
        self.keys = {i: allocate((blocks, block_size, heads, key_dim), dtype=dtype, device=device) for i in layers}
        self.values = {i: allocate((blocks, block_size, heads, value_dim), dtype=dtype, device=device) for i in layers}
        self.bytes_per_block = block_size * len(layers) * heads * (key_dim + value_dim) * dtype.itemsize
        self.zeroed = blocks if device.type == "cuda" else 0  # blocks [0, zeroed) are initialized
        self.ensure_zeroed(SCRATCH_BLOCK)
        # Each batch row's block table (row `rows`: the scratch row of padding), long for indexing; its last column
        # stays the scratch block, which a gathered read may take past a row's blocks (see `prepare`).
        self.tables = torch.zeros(rows + 1, max_blocks + 1, dtype=torch.long, device=device)
        self.writes: torch.Tensor | None = None  # flat positions of the forward's new tokens, in row-major order
        self.reads: torch.Tensor | None = None  # gather: the rows' first blocks, covering kv_len, row after row

    def ensure_zeroed(self, block: int) -> None:
        """Blocks up to `block` are initialized (a pool hands out blocks in id order until it first reuses one)."""
        if block >= self.zeroed:
            for layer in (*self.keys.values(), *self.values.values()):
                layer[self.zeroed : block + 1].zero_()
            self.zeroed = block + 1

    def set_table(self, row: int, blocks: Sequence[int]) -> None:
        self.ensure_zeroed(max(blocks, default=SCRATCH_BLOCK))
        self.tables[row, : len(blocks)] = torch.tensor(blocks, dtype=torch.long)

    def prepare(self, rows: torch.Tensor, positions: torch.Tensor, kv_len: int, mode: ReadMode) -> None:
        """Flat pool positions of `positions` (rows, n) of batch rows `rows` (a position below 0, padding, is the
        scratch block's first entry); in gather mode the blocks that cover kv_len positions of each row."""
        index = positions.clamp(min=0)
        blocks = self.tables[rows[:, None], index // self.block_size]
        self.writes = torch.where(positions >= 0, blocks * self.block_size + index % self.block_size, 0).reshape(-1)
        if mode == "gather":  # whole blocks: one contiguous copy of each, not one of each position
            # Always more positions than kv_len, and at least two blocks: under torch.compile a read of exactly kv_len
            # positions, or of one block, is a class of shapes of its own, which would compile again after ready.
            self.reads = self.tables[rows, : max(2, kv_len // self.block_size + 1)].reshape(-1)


class PagedCache:
    """Duck-typed as a transformers Cache (only `update` and `get_seq_length` are called with a 4-D mask given).

    Every layer's keys and values are in the main pool (`main`), except, where the geometry gives sliding layers a pool
    of their own (KvGeometry.window_blocks), those of the layers that slide (`sliding_layers`), which are in `window`:
    there a request's table points to the blocks of its last positions only (the scratch block before them), which
    is all that a sliding layer reads."""

    def __init__(
        self, config: PretrainedConfig, kv: KvGeometry, rows: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        self.heads, self.key_dim, self.value_dim = kv_shape(config)
        layers = config.get_text_config().num_hidden_layers
        sliding = sliding_layers(config)[1] if kv.window_blocks else frozenset()
        self.block_size = kv.block_size
        self.max_blocks = -(-kv.context // kv.block_size)
        geometry = (kv.block_size, self.max_blocks, (self.heads, self.key_dim, self.value_dim), rows, dtype, device)
        self.main = _Pool([i for i in range(layers) if i not in sliding], kv.blocks, *geometry)
        self.window = _Pool(sorted(sliding), kv.window_blocks, *geometry) if sliding else None
        self.pools = [self.main] if self.window is None else [self.main, self.window]
        self._pool_of = [self.main if self.window is None or i not in sliding else self.window for i in range(layers)]
        self.device = device
        # On CUDA one kernel writes a forward's new keys and values (kernels/kv_write.py); elsewhere two index writes.
        self._one_write = (
            device.type == "cuda" and kv_write is not None and self.key_dim == self.value_dim
            and kv_write.supported(self.key_dim)
        )  # fmt: skip
        self._kv_len = 0
        self._mode: ReadMode = "gather"

    @property
    def resident_bytes(self) -> int:
        """Bytes of the pools that have been touched (the rest may not be backed by memory yet)."""
        return sum(pool.zeroed * pool.bytes_per_block for pool in self.pools)

    @property
    def tables(self) -> torch.Tensor:
        """The main pool's block tables."""
        return self.main.tables

    def set_table(self, row: int, blocks: Sequence[int], window_blocks: Sequence[int] = ()) -> None:
        """Batch row `row`'s block tables: the blocks of its request in position order, and those of its window in the
        sliding layers' pool."""
        self.main.set_table(row, blocks)
        if self.window is not None:
            self.window.set_table(row, window_blocks)

    def set_entries(
        self, rows: torch.Tensor, index: torch.Tensor, blocks: torch.Tensor, window_blocks: torch.Tensor
    ) -> None:
        """Table entry `index` of each batch row in `rows` (a decode step's new position): its block in the main pool,
        and in the sliding layers' pool."""
        self.main.tables[rows, index] = blocks
        if self.window is not None:
            self.window.tables[rows, index] = window_blocks

    def ensure_zeroed(self, block: int, window_block: int = SCRATCH_BLOCK) -> None:
        """Blocks up to `block` of the main pool, and up to `window_block` of the sliding layers', are initialized."""
        self.main.ensure_zeroed(block)
        if self.window is not None:
            self.window.ensure_zeroed(window_block)

    def paged_tables(self, rows: torch.Tensor) -> dict[str, torch.Tensor]:
        """The rows' tables as a paged decode step's attention reads them (engine/runners/torch/attention.py):
        `kv_block_tables`, and `kv_window_tables` for the sliding layers where they have a pool of their own."""
        tables = {"kv_block_tables": self.main.tables[rows].to(torch.int32)}
        if self.window is not None:
            tables["kv_window_tables"] = self.window.tables[rows].to(torch.int32)
        return tables

    def prepare(self, rows: torch.Tensor, positions: torch.Tensor, kv_len: int, mode: ReadMode) -> None:
        """Set up the next forward: batch row b is the request of batch row rows[b] and feeds its new tokens at
        positions[b] (shape (rows, new tokens); -1: padding); attention reads as `mode` says, in gather mode
        positions [0, kv_len) of each row."""
        self._kv_len, self._mode = kv_len, mode
        for pool in self.pools:
            pool.prepare(rows, positions, kv_len, mode)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        pool = self._pool_of[layer_idx]
        keys, values = pool.keys[layer_idx], pool.values[layer_idx]
        if key_states.shape[1::2] != keys.shape[2:] or value_states.shape[1::2] != values.shape[2:]:
            raise ValueError(
                f"layer {layer_idx} caches keys of {tuple(key_states.shape[1::2])} and values of "
                f"{tuple(value_states.shape[1::2])} (heads, width), not the {tuple(keys.shape[2:])} and "
                f"{tuple(values.shape[2:])} that its config gives (kv_cache.kv_shape)"
            )
        flat_keys = keys.view(-1, self.heads, self.key_dim)
        flat_values = values.view(-1, self.heads, self.value_dim)
        if self._one_write:
            kv_write.write_kv(key_states, value_states, flat_keys, flat_values, pool.writes)
        else:
            flat_keys[pool.writes] = key_states.transpose(1, 2).reshape(-1, self.heads, self.key_dim)
            flat_values[pool.writes] = value_states.transpose(1, 2).reshape(-1, self.heads, self.value_dim)
        if self._mode == "new":
            return key_states, value_states
        if self._mode == "paged":
            return keys, values
        rows = key_states.shape[0]
        return self._gather(keys, pool.reads, rows), self._gather(values, pool.reads, rows)

    def _gather(self, pool: torch.Tensor, reads: torch.Tensor | None, rows: int) -> torch.Tensor:
        """Positions [0, kv_len) of each row, from its blocks: (rows, kv_heads, kv_len, head_dim)."""
        blocks = pool.index_select(0, reads).view(rows, -1, self.heads, pool.shape[-1])
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
