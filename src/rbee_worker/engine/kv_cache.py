"""The KV cache: one slot per running sequence, allocated once after the weights, given to transformers' own model
classes as their cache.

Each layer holds keys and values as `[slots, kv_heads, slot_len + 1, head_dim]`. Before a forward the engine says
which rows of the batch are which slots (a contiguous range) and where the new tokens go; the model's attention
layers call `update`, which writes the new keys and values there and returns the range's cache up to `kv_len`, and
the 4-D attention mask that the engine passes says which of those positions each query sees.

Position `slot_len` of every slot is scratch: a batch row without a sequence (a free slot, or a sequence still in
prefill, inside a decode batch) writes there and is never read. Memory is zeroed lazily up to the longest context
seen, so on a CPU only the part in use becomes resident; masked positions then hold finite values (zero, or an
earlier sequence's), never the NaN that uninitialized memory could hold and that a zero attention weight would not
cancel.
"""

from collections.abc import Sequence

import torch
from transformers import PretrainedConfig


def kv_bytes_per_token(config: PretrainedConfig, dtype: torch.dtype) -> int:
    """Bytes of keys and values that one token of context takes over all layers."""
    heads, head_dim = kv_shape(config)
    return 2 * config.get_text_config().num_hidden_layers * heads * head_dim * dtype.itemsize


def kv_shape(config: PretrainedConfig) -> tuple[int, int]:
    text = config.get_text_config()
    heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    return heads, head_dim


class SlotCache:
    """Duck-typed as a transformers Cache (only `update` and `get_seq_length` are called with a 4-D mask given)."""

    def __init__(
        self, config: PretrainedConfig, slots: int, slot_len: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        heads, head_dim = kv_shape(config)
        layers = config.get_text_config().num_hidden_layers
        shape = (slots, heads, slot_len + 1, head_dim)  # + 1: the scratch position
        self.keys = [torch.empty(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.values = [torch.empty(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.slots, self.slot_len = slots, slot_len
        self.bytes_per_token = kv_bytes_per_token(config, dtype)
        self._zeroed = 0  # positions [0, _zeroed) of every slot are initialized
        for layer in (*self.keys, *self.values):
            layer[:, :, slot_len].zero_()  # the scratch position
            layer[:, :, 0].zero_()  # dummy rows attend to position 0 of their slot
        self._kv_len = self._first = self._count = 0  # the batch rows are slots _first.. _first + _count - 1
        self._gather: torch.Tensor | None = None  # or, when they are not a contiguous range, these slots
        self._positions: torch.Tensor | None = None
        self.row_index: torch.Tensor | None = None  # the batch rows' slots, as a column

    @property
    def resident_bytes(self) -> int:
        """Bytes of the cache that have been touched (the rest may not be backed by memory yet)."""
        return self.slots * self._zeroed * self.bytes_per_token

    def prepare(self, first_row: int, positions: torch.Tensor, kv_len: int) -> None:
        """Set up the next forward: its batch rows are slots first_row.. first_row + len(positions) - 1; row b's new
        tokens go to positions[b] (shape (rows, new tokens)); attention reads positions [0, kv_len)."""
        self.prepare_slots(range(first_row, first_row + positions.shape[0]), positions, kv_len)

    def prepare_slots(self, slots: Sequence[int], positions: torch.Tensor, kv_len: int) -> None:
        """As prepare, for batch rows that are any slots: attention then reads a gathered copy of those slots (a
        contiguous range is read in place)."""
        self._ensure_zeroed(kv_len)
        self._kv_len, self._positions = kv_len, positions
        self.row_index = torch.tensor(slots, device=positions.device)[:, None]
        self._first, self._count = slots[0], len(slots)
        contiguous = list(slots) == list(range(slots[0], slots[0] + len(slots)))
        self._gather = None if contiguous else self.row_index[:, 0]

    def prepare_graph_rows(self, row_index: torch.Tensor, positions: torch.Tensor, kv_len: int) -> None:
        """As prepare_slots, for batch rows given as a (rows, 1) device tensor of slots (a CUDA graph's static input,
        filled before each replay): attention reads them through a gather."""
        self._ensure_zeroed(kv_len)
        self._kv_len, self._positions = kv_len, positions
        self.row_index, self._gather = row_index, row_index[:, 0]

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        keys[self.row_index, :, self._positions] = key_states.transpose(1, 2)
        values[self.row_index, :, self._positions] = value_states.transpose(1, 2)
        # Ints and None, not a slice object: torch.compile then treats the row count as dynamic, not a constant.
        rows = slice(self._first, self._first + self._count) if self._gather is None else self._gather
        return keys[rows, :, : self._kv_len], values[rows, :, : self._kv_len]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._kv_len

    def _ensure_zeroed(self, kv_len: int) -> None:
        if kv_len > self._zeroed:
            for layer in (*self.keys, *self.values):
                layer[:, :, self._zeroed : kv_len].zero_()
            self._zeroed = kv_len


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
