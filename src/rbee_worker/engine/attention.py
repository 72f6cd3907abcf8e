"""The attention function the engine gives transformers' model classes (registered through transformers'
AttentionInterface, so the models' own attention layers call it): PyTorch's scaled_dot_product_attention, like
transformers' "sdpa", with three shapes of the engine's forwards sent to faster kernels.

- A decode step on CUDA: the paged cache hands over its whole pool (kv_cache.PagedCache's `paged` mode) and the
  forward's `kv_block_tables` / `kv_lengths` arguments say where each row's keys and values are; decode_attention.py's
  paged split-KV kernel reads them there.
- A decode step elsewhere (one query token per row, keys gathered): the query heads that share a key/value head are
  folded into the query length (`[rows, kv_heads, groups, head_dim]`), so attention reads each cached key and value
  once instead of through `repeat_kv`'s copy for every query head; the engine's mask (`[rows, 1, 1, span]`) applies
  unchanged. transformers 5.24 does this itself outside torch.compile; this does it inside too, and on older versions.
- A single-row prompt chunk from position 0 (a first prefill): its mask is exactly causal, so it is dropped for
  `is_causal=True`, which lets SDPA take its flash kernel with grouped heads, as a bare forward over the prompt does.

Everything else goes to transformers' own sdpa function unchanged.

A sliding layer (transformers hands its attention `sliding_window`: Mistral, Gemma 2 / 3, gpt-oss, Qwen with
`use_sliding_window`, ...) sees only the last `sliding_window` positions, itself included, as transformers'
`sliding_window_overlay` masks them. The engine's masks are causal only, so the window is applied here, per layer:
from the forward's `query_positions` (the runner passes them for a model whose config has a window; a key's index is
its position in gathered and first-chunk reads), or from `kv_lengths` for the paged cache, read by paged_reference
(the paged kernel takes no window).
"""

import importlib.util

import torch
from transformers import AttentionInterface, PretrainedConfig
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from rbee_worker.errors import ModelLoadError

if importlib.util.find_spec("triton") is not None:  # CUDA builds of PyTorch
    from rbee_worker.engine import decode_attention
else:
    decode_attention = None

NAME = "rbee_sdpa"


def attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    rows, heads, q_len, head_dim = query.shape
    plain = dropout == 0.0 and kwargs.get("softcap") is None and kwargs.get("position_bias") is None
    # Passed by the layer (most models), or only set on a sliding layer's module (Qwen2-MoE); 0 is none.
    window = kwargs.get("sliding_window", getattr(module, "sliding_window", None)) or None
    tables = kwargs.get("kv_block_tables")
    if tables is not None:  # the paged cache's pool: [blocks, block_size, kv_heads, head_dim]
        assert plain, "paged decode steps run without softcap or biases"
        scale = head_dim**-0.5 if scaling is None else scaling
        lengths = kwargs["kv_lengths"]
        kernel = decode_attention is not None and decode_attention.supported(query, key, value)
        if window is None and kernel:
            splits = decode_attention.splits_for(rows, key.shape[2], query.device)
            return decode_attention.paged_decode_attention(query, key, value, tables, lengths, scale, splits), None
        return paged_reference(query, key, value, tables, lengths, scale, window), None
    if window is not None and not (rows == 1 and q_len == key.shape[2] and q_len <= window):
        # (A first chunk within the window sees what a causal mask shows it.)
        attention_mask = windowed(attention_mask, kwargs["query_positions"], key.shape[2], window)
    kv_heads = key.shape[1]
    if plain and q_len == 1 and heads != kv_heads:
        folded = query.reshape(rows, kv_heads, heads // kv_heads, head_dim)
        output = torch.nn.functional.scaled_dot_product_attention(
            folded, key, value, attn_mask=attention_mask, scale=scaling
        )
        return output.reshape(rows, 1, heads, value.shape[-1]), None
    if plain and rows == 1 and q_len == key.shape[2] and q_len > 1 and (window is None or q_len <= window):
        # The engine masks a chunk that starts at position 0 causally and nothing else (see the module docstring).
        # From the module's own int (as transformers' sdpa reads it): under torch.compile with dynamic shapes a
        # comparison of head counts is symbolic, and SDPA's flag takes a plain bool only. (Where compiled.py makes
        # module ints dynamic, the CUDA decoder layers, this int is symbolic too: dynamo then leaves this call out of
        # the compiled graph, which costs nothing inside the prefill graphs that replay it.)
        grouped = getattr(module, "num_key_value_groups", 1) > 1
        output = torch.nn.functional.scaled_dot_product_attention(
            query, key, value, is_causal=True, scale=scaling, enable_gqa=grouped
        )
        return output.transpose(1, 2).contiguous(), None
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)


def windowed(mask: torch.Tensor, query_positions: torch.Tensor, key_len: int, window: int) -> torch.Tensor:
    """The engine's additive mask ([rows, 1, q_len, key_len]) of a sliding layer: a query at position p also loses
    the keys at positions <= p - window. `query_positions`: [rows, q_len] (-1 for padding, which loses nothing)."""
    keys = torch.arange(key_len, device=mask.device)
    outside = keys <= query_positions[:, None, :, None] - window
    return mask.masked_fill(outside, torch.finfo(mask.dtype).min)


def config_window(config: PretrainedConfig) -> int | None:
    """The sliding window of the model's config, None where it has none (Qwen2-MoE's config says 0 for none)."""
    return getattr(config.get_text_config(), "sliding_window", None) or None


def paged_reference(
    query: torch.Tensor,
    key_pool: torch.Tensor,
    value_pool: torch.Tensor,
    tables: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """What the paged decode kernel computes, in plain torch: every position of each row's whole table gathered, the
    ones past its length masked (a row of length 0 sees position 0), and with a `window` those at or before its last
    position - window. Slow; for devices without the kernel (tests of the graph path on a CPU), dtypes it does not
    take, and sliding layers."""
    heads = query.shape[1]
    block_size, kv_heads = key_pool.shape[1], key_pool.shape[2]
    span = tables.shape[1] * block_size
    positions = torch.arange(span, device=query.device)
    flat = tables.long()[:, positions // block_size] * block_size + positions % block_size
    keys = key_pool.reshape(-1, kv_heads, key_pool.shape[3])[flat].transpose(1, 2)
    values = value_pool.reshape(-1, kv_heads, value_pool.shape[3])[flat].transpose(1, 2)
    visible = positions[None, :] < lengths.clamp(min=1)[:, None]
    if window is not None:
        visible &= positions[None, :] > lengths[:, None] - 1 - window
    mask = torch.where(visible, 0.0, torch.finfo(query.dtype).min).to(query.dtype)[:, None, None, :]
    output = torch.nn.functional.scaled_dot_product_attention(
        query, keys, values, attn_mask=mask, scale=scale, enable_gqa=heads != kv_heads
    )
    return output.transpose(1, 2)


def use_engine_attention(model: torch.nn.Module, context_length: int) -> bool:
    """Route the model's attention through `attention` when it uses transformers' sdpa (the default); False and
    unchanged otherwise (eager or flash attention, as the model class or the caller asks). Raises ModelLoadError for
    an attention that the engine would compute otherwise than transformers: chunked attention (Llama 4), and a window
    shorter than the context outside the engine's attention (models/hf.py refuses other layer types)."""
    text = model.config.get_text_config()
    if getattr(text, "attention_chunk_size", None) is not None:
        raise ModelLoadError(f"{text.model_type}: chunked attention (attention_chunk_size) is not served yet")
    ours = getattr(model.config, "_attn_implementation", None) == "sdpa"
    if ours:
        AttentionInterface.register(NAME, attention)
        model.set_attn_implementation(NAME)
        ours = model.config._attn_implementation == NAME
    window = config_window(model.config)
    if not ours and window is not None and window < context_length:
        raise ModelLoadError(
            f"{text.model_type}: a sliding window of {window} tokens under transformers' "
            f"{model.config._attn_implementation} attention is not served yet (only under sdpa's)"
        )
    return ours
