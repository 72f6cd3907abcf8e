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
        self._first = self._rows = self._kv_len = 0
        self._positions: torch.Tensor | None = None
        self.row_index: torch.Tensor | None = None  # the batch rows' slots, as a column

    @property
    def resident_bytes(self) -> int:
        """Bytes of the cache that have been touched (the rest may not be backed by memory yet)."""
        return self.slots * self._zeroed * self.bytes_per_token

    def prepare(self, first_row: int, positions: torch.Tensor, kv_len: int) -> None:
        """Set up the next forward: its batch rows are slots first_row.. first_row + len(positions) - 1; row b's new
        tokens go to positions[b] (shape (rows, new tokens)); attention reads positions [0, kv_len)."""
        self._ensure_zeroed(kv_len)
        self._first, self._rows, self._kv_len = first_row, positions.shape[0], kv_len
        self._positions = positions
        self.row_index = torch.arange(first_row, first_row + self._rows, device=positions.device)[:, None]

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        keys[self.row_index, :, self._positions] = key_states.transpose(1, 2)
        values[self.row_index, :, self._positions] = value_states.transpose(1, 2)
        rows = slice(self._first, self._first + self._rows)
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


def prefill_mask(start: int, count: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """(1, 1, count, start + count) causal mask for `count` new tokens after `start` cached ones."""
    queries = torch.arange(start, start + count, device=device)[:, None]
    visible = torch.arange(start + count, device=device)[None, :] <= queries
    return _additive(visible, dtype)[None, None]


def _additive(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    zero = torch.zeros((), dtype=dtype, device=visible.device)
    return torch.where(visible, zero, torch.finfo(dtype).min)
