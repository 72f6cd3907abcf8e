"""The attention function the engine gives transformers' model classes (registered through transformers'
AttentionInterface, so the models' own attention layers call it): PyTorch's scaled_dot_product_attention, like
transformers' "sdpa", with three shapes of the engine's forwards sent to faster kernels.

- A decode step on CUDA: the paged cache hands over its whole pool (kv_cache.PagedCache's `paged` mode) and the
  forward's `kv_block_tables` / `kv_lengths` arguments say where each row's keys and values are; decode_attention.py's
  paged split-KV kernel reads them there (a sliding layer's window only).
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
its position in gathered and first-chunk reads), or from `kv_lengths` for the paged cache (the paged kernel's
`window`, or paged_reference's).

A model whose transformers class computes attention only eagerly (Gemma 2's logit soft-capping, gpt-oss's attention
sinks: no sdpa) gets `eager_attention` instead: the same window applied to the engine's mask, then the model's own
`eager_attention_forward`, so that soft-capping, `query_pre_attn_scalar` and sinks stay transformers' arithmetic. It
serves every path the engine has (gathered prompt chunks and decode steps, first chunks, prefix-cache hits, the paged
pool of decode graphs, which it gathers through the tables as paged_reference does). The decode steps of the models
in KERNEL_EAGER go to the paged kernel instead where it takes them (CUDA, bfloat16 / float16), which computes their
eager functions' soft-capping and sinks itself. A soft-capped model is given transformers' eager attention whatever
its class defaults to: some transformers versions (5.17) default Gemma 2 to sdpa, which leaves the capping out.
"""

import importlib.util
import sys
from collections.abc import Callable

import torch
from transformers import AttentionInterface, PretrainedConfig
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from rbee_worker.errors import ModelLoadError

if importlib.util.find_spec("triton") is not None:  # CUDA builds of PyTorch
    from rbee_worker.kernels import decode_attention
else:
    decode_attention = None

NAME = "rbee_sdpa"
# Model types whose eager attention is softmax attention plus what the paged decode kernel computes (a window,
# `softcap`, the `s_aux` sinks): their paged decode steps take the kernel where it runs.
KERNEL_EAGER = {"gemma2", "gpt_oss"}
# Model types whose layers turn the engine's mask into one of each head's own (Doge's dynamic mask: an additive bias).
PER_HEAD_MASKS = {"doge"}
EAGER_NAME = "rbee_eager"


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
    tables = layer_tables(kwargs, window)
    if tables is not None:  # the paged cache's pool: [blocks, block_size, kv_heads, head_dim]
        assert plain, "paged decode steps run without softcap or biases"
        scale = head_dim**-0.5 if scaling is None else scaling
        lengths = kwargs["kv_lengths"]
        output = paged_kernel(query, key, value, tables, lengths, scale, window)
        if output is None:
            output = paged_reference(query, key, value, tables, lengths, scale, window)
        return output, None
    if window is not None and not (rows == 1 and q_len == key.shape[2] and q_len <= window):
        # (A first chunk within the window sees what a causal mask shows it.)
        attention_mask = windowed(attention_mask, kwargs["query_positions"], key.shape[2], window)
    kv_heads = key.shape[1]
    # The engine's mask, or one of the same shape: a layer's own mask per head (Doge's dynamic mask, an additive bias
    # of each head) neither folds into the key/value heads nor is causal only.
    shared_mask = attention_mask is None or attention_mask.shape[1] == 1
    if plain and shared_mask and q_len == 1 and heads != kv_heads:
        folded = query.reshape(rows, kv_heads, heads // kv_heads, head_dim)
        output = torch.nn.functional.scaled_dot_product_attention(
            folded, key, value, attn_mask=attention_mask, scale=scaling
        )
        return output.reshape(rows, 1, heads, value.shape[-1]), None
    first = rows == 1 and q_len == key.shape[2] and q_len > 1 and (window is None or q_len <= window)
    if plain and shared_mask and first:
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


def layer_tables(kwargs: dict[str, object], window: int | None) -> torch.Tensor | None:
    """The block tables of a paged decode step for a layer with this window: a sliding layer's in the sliding layers'
    own pool where the cache keeps one (`kv_window_tables`, kv_cache.PagedCache.paged_tables), else
    `kv_block_tables`; None outside a paged step."""
    name = "kv_window_tables" if window is not None and "kv_window_tables" in kwargs else "kv_block_tables"
    tables = kwargs.get(name)
    return tables if isinstance(tables, torch.Tensor) else None


def paged_kernel(
    query: torch.Tensor,
    key_pool: torch.Tensor,
    value_pool: torch.Tensor,
    tables: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
    window: int | None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """A decode step's attention over the paged pool by decode_attention.py's kernel, None where it does not take
    these tensors (no Triton, or decode_attention.supported says no)."""
    if decode_attention is None or not decode_attention.supported(query, key_pool, value_pool):
        return None
    splits = decode_attention.splits_for(query.shape[0], key_pool.shape[2], query.device)
    return decode_attention.paged_decode_attention(
        query, key_pool, value_pool, tables, lengths, scale, splits, window, softcap, sinks
    )


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
    """What the paged decode kernel computes, in plain torch (see paged_gather). Slow; for devices without the kernel
    (tests of the graph path on a CPU), dtypes it does not take, and sliding layers."""
    keys, values, mask = paged_gather(key_pool, value_pool, tables, lengths, query.dtype, window)
    output = torch.nn.functional.scaled_dot_product_attention(
        query, keys, values, attn_mask=mask, scale=scale, enable_gqa=query.shape[1] != keys.shape[1]
    )
    return output.transpose(1, 2)


def paged_gather(
    key_pool: torch.Tensor,
    value_pool: torch.Tensor,
    tables: torch.Tensor,
    lengths: torch.Tensor,
    dtype: torch.dtype,
    window: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A decode step's keys and values read from the paged pool ([blocks, block_size, kv_heads, head_dim]): every
    position of each row's whole table gathered, as `[rows, kv_heads, span, head_dim]`, and the additive mask
    (`[rows, 1, 1, span]`) that hides the ones past its length (a row of length 0 sees position 0) and, with a
    `window`, those at or before its last position - window."""
    block_size, kv_heads = key_pool.shape[1], key_pool.shape[2]
    span = tables.shape[1] * block_size
    positions = torch.arange(span, device=key_pool.device)
    flat = tables.long()[:, positions // block_size] * block_size + positions % block_size
    keys = key_pool.reshape(-1, kv_heads, key_pool.shape[3])[flat].transpose(1, 2)
    values = value_pool.reshape(-1, kv_heads, value_pool.shape[3])[flat].transpose(1, 2)
    visible = positions[None, :] < lengths.clamp(min=1)[:, None]
    if window is not None:
        visible &= positions[None, :] > lengths[:, None] - 1 - window
    mask = torch.where(visible, 0.0, torch.finfo(dtype).min).to(dtype)[:, None, None, :]
    return keys, values, mask


def eager_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The attention of a model that transformers computes eagerly (see the module docstring): the layer's window
    applied to the engine's mask (from the forward's `query_positions`, or read from the paged pool through
    `kv_block_tables` / `kv_lengths`), then the model's own eager function with everything the layer passed (its
    scaling, `softcap`, `s_aux` ...)."""
    window = kwargs.get("sliding_window", getattr(module, "sliding_window", None)) or None
    tables = layer_tables(kwargs, window)
    if tables is not None and dropout == 0.0 and module.config.model_type in KERNEL_EAGER:
        scale = query.shape[3] ** -0.5 if scaling is None else scaling
        lengths = kwargs["kv_lengths"]
        output = paged_kernel(
            query, key, value, tables, lengths, scale, window, kwargs.get("softcap"), kwargs.get("s_aux")
        )
        if output is not None:
            return output, None
    if tables is not None:  # the paged cache's pool: this row's keys and values gathered through its table
        key, value, attention_mask = paged_gather(key, value, tables, kwargs["kv_lengths"], query.dtype, window)
    elif window is not None:
        attention_mask = windowed(attention_mask, kwargs["query_positions"], key.shape[2], window)
    function = own_eager_function(module)
    assert function is not None, "use_engine_attention refuses a layer without an eager function"
    return function(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)


def own_eager_function(module: torch.nn.Module) -> Callable[..., tuple[torch.Tensor, torch.Tensor]] | None:
    """The `eager_attention_forward` of the modeling module that defines the attention layer `module` (the function
    transformers calls for it under "eager"); None where that module has none (`use_engine_attention` refuses it)."""
    function = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
    return function if callable(function) else None


def use_engine_attention(model: torch.nn.Module, context_length: int) -> bool:
    """Route the model's attention through `attention` when it uses transformers' sdpa (the default), through
    `eager_attention` when it uses transformers' eager attention and has a window shorter than the context (Gemma 2,
    gpt-oss); False and unchanged otherwise (flash attention, or eager without a window, as the model class or the
    caller asks). Raises ModelLoadError for an attention that the engine would compute otherwise than transformers:
    chunked attention (Llama 4), a mask of each head's own on CUDA (PER_HEAD_MASKS), a window outside sdpa and eager,
    an eager attention layer whose modeling module has no `eager_attention_forward`, and on CUDA any attention but the
    engine's (loading/hf.py refuses other layer types and attention kinds)."""
    text = model.config.get_text_config()
    if getattr(text, "attention_chunk_size", None) is not None:
        raise ModelLoadError(f"{text.model_type}: chunked attention (attention_chunk_size) is not served yet")
    if text.model_type in PER_HEAD_MASKS and model.device.type == "cuda":
        raise ModelLoadError(
            f"{text.model_type}: an attention mask of each head's own (a dynamic mask) on CUDA is not served yet "
            "(the paged decode kernel takes none); on a CPU it is"
        )
    implementation = getattr(model.config, "_attn_implementation", None)
    if implementation == "sdpa" and getattr(text, "attn_logit_softcapping", None) is not None:
        model.set_attn_implementation("eager")  # the only attention of transformers that soft-caps
        implementation = model.config._attn_implementation
    window = config_window(model.config)
    sliding = window is not None and window < context_length
    if implementation == "sdpa":
        AttentionInterface.register(NAME, attention)
        model.set_attn_implementation(NAME)
        if model.config._attn_implementation == NAME:
            return True
    elif implementation == "eager" and sliding:
        # transformers' attention layers, by its naming (Gemma2Attention, GptOssAttention), each with the function
        # that its modeling module defines for eager attention.
        layers = [m for m in model.modules() if type(m).__name__.endswith("Attention")]
        lacking = sorted({type(m).__name__ for m in layers if own_eager_function(m) is None})
        if lacking or not layers:
            raise ModelLoadError(
                f"{text.model_type}: a sliding window under transformers' eager attention of "
                f"{', '.join(lacking) or 'its layers'} (no eager_attention_forward beside them) is not served yet"
            )
        AttentionInterface.register(EAGER_NAME, eager_attention)
        model.set_attn_implementation(EAGER_NAME)
        if model.config._attn_implementation == EAGER_NAME:
            return True
    if sliding:
        raise ModelLoadError(
            f"{text.model_type}: a sliding window of {window} tokens under transformers' "
            f"{model.config._attn_implementation} attention is not served yet (only under sdpa's and eager's)"
        )
    if model.device.type == "cuda":  # its decode steps would hand the whole paged pool to transformers' own function
        raise ModelLoadError(
            f"{text.model_type}: transformers' {model.config._attn_implementation} attention on CUDA is not served yet "
            "(the engine's decode steps read the paged KV cache through its own attention); on a CPU it is"
        )
    return False
