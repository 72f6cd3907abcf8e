"""Mixture-of-experts layers on CUDA as fused Triton kernels, in transformers' own experts modules.

transformers v5 runs the experts of every MoE family through one interface (`transformers.integrations.moe`): the
model's router picks each token's experts and weights, and the experts module's forward, chosen by
`config._experts_implementation`, computes the weighted sum of their outputs. `use_fused_experts` registers this
module's forward there and selects it, so the routing (softmax or sigmoid scores, DeepSeek's groups, gpt-oss's biases,
shared experts) stays the model's own arithmetic and only the expert products change.

The products follow vLLM's and SGLang's fused MoE: the (token, expert) pairs are sorted by expert into blocks of
BLOCK_M rows, each block padded with a sentinel, so that one launch multiplies every expert's rows by its weights with
`tl.dot` and a program reads only its block's expert; blocks past the used ones exit at once, so the grid is fixed for
a given count of pairs (CUDA graphs) while a token of one step reads only its routed experts' weights.
- `_align`: the sort, in one program (a decode step's pairs, and any count, chunk by chunk).
- `_experts_up`: gate and up projections (and their biases) with the activation applied in float32 before the one
  rounding to the activations' dtype: SiLU(gate) * up, or gpt-oss's clamped SwiGLU over interleaved columns.
- `_experts_down`: the down projection (and bias) times the pair's routing weight, in float32; the caller sums each
  token's top-k rows.
Products accumulate in float32; float32 weights multiply in float32 (not TF32), so a float32 model on CUDA gives the
CPU's tokens.
The weights are read in transformers' layouts, whatever their strides: gate_up [E, 2I, H] and down [E, H, I], or
transposed ([E, H, 2I], [E, I, H]) for gpt-oss.
"""

from collections.abc import Sequence

import torch
import triton
import triton.language as tl
from transformers import activations
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, _default_apply_gate

from rbee_worker.kernels.cuda_weight_only import FLOAT_ONE, _weight_tile, pack_int4
from rbee_worker.loading.gguf.dequant import KERNEL_DTYPE, int4_affine, int8_per_row

NAME = "rbee_fused"
SILU: tl.constexpr = tl.constexpr(0)  # the activations the up kernel applies
CLAMPED_SWIGLU: tl.constexpr = tl.constexpr(1)
FLOAT: tl.constexpr = tl.constexpr(0)  # how the weights are held
INT8: tl.constexpr = tl.constexpr(1)
INT4: tl.constexpr = tl.constexpr(2)
SILU_MODULES = (torch.nn.SiLU, activations.SiLUActivation)  # config.hidden_act "swish" and "silu"
# Pairs (and blocks) that _align handles at a time: up to 128, fewer for fewer pairs (16 at least; a decode step of
# one sequence has top_k), since its [chunk, experts] comparisons are the one program's latency in every layer; and
# the sorted rows it fills with the sentinel at a time.
ALIGN_CHUNK, FILL_CHUNK = 128, 1024


def block_rows(pairs: int, experts: int) -> int:
    """BLOCK_M for this many (token, expert) pairs: 16 while an expert averages at most 32 of them (decode steps;
    vLLM's default below one token per expert), more for prompt chunks, so that a block's weight tile serves more
    rows."""
    per_expert = pairs / experts
    return 16 if per_expert <= 32 else 32 if per_expert <= 64 else 64


def _product_configs() -> list[triton.Config]:
    """Tiles of BLOCK_N outputs by BLOCK_K inputs: narrow ones with long input steps for a decode step's few blocks
    (many programs over each expert's weights, each streaming a long run of them), wider ones for prompt chunks."""
    return [
        triton.Config({"BLOCK_N": n, "BLOCK_K": k}, num_warps=w, num_stages=s)
        for n, k, w, s in (
            (16, 256, 4, 3), (32, 256, 4, 3), (32, 128, 4, 3), (64, 64, 4, 3), (64, 128, 4, 3), (128, 64, 4, 3),
            (128, 128, 8, 3),
        )
    ]  # fmt: skip


@triton.jit
def _align(
    experts_ptr, sorted_ptr, block_expert_ptr, P, max_blocks,
    BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, CHUNK: tl.constexpr, FILL: tl.constexpr,
):  # fmt: skip
    """Pairs 0..P-1 (pair p: token p // top_k and its expert experts[p]) sorted by expert: expert e's pairs, in order,
    fill sorted[start_e ..] where start_e is the sum of the experts before it's counts rounded up to BLOCK_M; the rest
    of `sorted` holds P (no pair). block_expert[b] is the expert of rows b * BLOCK_M .., -1 past the used blocks."""
    expert_ids = tl.arange(0, BLOCK_E)
    counts = tl.zeros((BLOCK_E,), dtype=tl.int32)
    for c0 in range(0, P, CHUNK):
        p = c0 + tl.arange(0, CHUNK)
        e = tl.load(experts_ptr + p, mask=p < P, other=-1)
        counts += tl.sum((e[:, None] == expert_ids[None, :]).to(tl.int32), axis=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    used = tl.sum(padded, axis=0)
    for b0 in range(0, max_blocks, CHUNK):
        b = b0 + tl.arange(0, CHUNK)
        # the expert whose rows hold the block's first row: the count of experts whose rows end at or before it
        expert = tl.sum((ends[None, :] <= (b * BLOCK_M)[:, None]).to(tl.int32), axis=1)
        tl.store(block_expert_ptr + b, tl.where(b * BLOCK_M < used, expert, -1), mask=b < max_blocks)
    for s0 in range(0, max_blocks * BLOCK_M, FILL):
        s = s0 + tl.arange(0, FILL)
        tl.store(sorted_ptr + s, tl.zeros((FILL,), dtype=tl.int32) + P, mask=s < max_blocks * BLOCK_M)
    tl.debug_barrier()  # the sentinels are written before the pairs overwrite some of them
    cursor = ends - padded  # each expert's next free row
    later = tl.arange(0, CHUNK)[:, None] > tl.arange(0, CHUNK)[None, :]
    for c0 in range(0, P, CHUNK):
        p = c0 + tl.arange(0, CHUNK)
        e = tl.load(experts_ptr + p, mask=p < P, other=-1)
        hits = (e[:, None] == expert_ids[None, :]).to(tl.int32)  # [CHUNK, BLOCK_E]
        before = tl.sum(((e[:, None] == e[None, :]) & later).to(tl.int32), axis=1)  # same expert, earlier in chunk
        row = tl.sum(hits * cursor[None, :], axis=1) + before
        tl.store(sorted_ptr + row, p, mask=p < P)
        cursor += tl.sum(hits, axis=0)


@triton.jit
def _tile(
    w, s, k0, K, cols, col_ok, stride_wk, stride_wn, stride_sk, one,
    WEIGHTS: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """One expert's weights (k, n) for k in k0 .. k0 + BLOCK_K and n in `cols`: float or int8 codes (the scales apply
    to the product), or int4 decoded with their groups' scales and zeros (kernels/cuda_weight_only.py's layout: words
    [K / 8, N] at stride_wk a row, scale-and-zero pairs [K / 32, N] at `s`, stride_sk a row)."""
    if WEIGHTS == INT4:
        rows = k0 // 8 + tl.arange(0, BLOCK_K // 8)
        words = tl.load(
            w + rows[:, None] * stride_wk + cols[None, :] * stride_wn,
            mask=(rows < K // 8)[:, None] & col_ok[None, :],
            other=0,
        )
        groups = k0 // 32 + tl.arange(0, BLOCK_K // 32)
        pairs = tl.load(
            s + groups[:, None] * stride_sk + cols[None, :], mask=(groups < K // 32)[:, None] & col_ok[None, :], other=0
        )
        return _weight_tile(words, pairs, one, BLOCK_K, BLOCK_N)
    else:
        ks = k0 + tl.arange(0, BLOCK_K)
        return tl.load(
            w + ks[:, None] * stride_wk + cols[None, :] * stride_wn, mask=(ks < K)[:, None] & col_ok[None, :], other=0
        )


@triton.autotune(configs=_product_configs(), key=["P_BUCKET", "N", "K", "BLOCK_M", "WEIGHTS"])
@triton.jit
def _experts_up(
    x_ptr, w_ptr, s_ptr, bias_ptr, y_ptr, sorted_ptr, block_expert_ptr, P, N, K, P_BUCKET,
    stride_we, stride_wk, stride_wn, stride_se, stride_sk, stride_be, gate_step, up_offset, alpha, limit, one,
    TOP_K: tl.constexpr, HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr, WEIGHTS: tl.constexpr,
    PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """y[p, n] = act(gate, up) for pair p's expert e and token t = p // TOP_K, with gate = x[t] . W[e][:, n gate_step]
    and up = x[t] . W[e][:, n gate_step + up_offset] (_tile's weights, W[e] at stride_we e; the scales' at stride_se
    e); N = I."""
    expert = tl.load(block_expert_ptr + tl.program_id(0)).to(tl.int64)
    if expert < 0:
        return
    pairs = tl.load(sorted_ptr + tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M))
    pair_ok = pairs < P
    tokens = pairs // TOP_K
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    gate_cols = cols * gate_step
    up_cols = gate_cols + up_offset
    w, s = w_ptr + expert * stride_we, s_ptr + expert * stride_se
    gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + tokens[:, None] * K + ks[None, :], mask=pair_ok[:, None] & (ks < K)[None, :], other=0.0)
        tile = _tile(w, s, k0, K, gate_cols, col_ok, stride_wk, stride_wn, stride_sk, one, WEIGHTS, BLOCK_K, BLOCK_N)
        gate += tl.dot(x, tile.to(x.dtype), input_precision=PRECISION)
        tile = _tile(w, s, k0, K, up_cols, col_ok, stride_wk, stride_wn, stride_sk, one, WEIGHTS, BLOCK_K, BLOCK_N)
        up += tl.dot(x, tile.to(x.dtype), input_precision=PRECISION)
    if WEIGHTS == INT8:
        gate *= tl.load(s + gate_cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        up *= tl.load(s + up_cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    if HAS_BIAS:
        bias = bias_ptr + expert * stride_be
        gate += tl.load(bias + gate_cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        up += tl.load(bias + up_cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    if ACTIVATION == SILU:
        y = gate * tl.sigmoid(gate) * up
    else:  # gpt-oss: gate clamped above, up clamped both ways, (up + 1) * gate * sigmoid(alpha * gate)
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
        y = (up + 1.0) * gate * tl.sigmoid(gate * alpha)
    mask = pair_ok[:, None] & col_ok[None, :]
    tl.store(y_ptr + pairs[:, None] * N + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.autotune(configs=_product_configs(), key=["P_BUCKET", "N", "K", "BLOCK_M", "WEIGHTS"])
@triton.jit
def _experts_down(
    h_ptr, w_ptr, s_ptr, bias_ptr, routing_ptr, out_ptr, sorted_ptr, block_expert_ptr, P, N, K, P_BUCKET,
    stride_we, stride_wk, stride_wn, stride_se, stride_sk, stride_be, one,
    HAS_BIAS: tl.constexpr, WEIGHTS: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """out[p, n] = routing[p] (h[p] . W[e][:, n] + bias[e, n]) in float32, for pair p's expert e; N = H, K = I."""
    expert = tl.load(block_expert_ptr + tl.program_id(0)).to(tl.int64)
    if expert < 0:
        return
    pairs = tl.load(sorted_ptr + tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M))
    pair_ok = pairs < P
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    w, s = w_ptr + expert * stride_we, s_ptr + expert * stride_se
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        h = tl.load(h_ptr + pairs[:, None] * K + ks[None, :], mask=pair_ok[:, None] & (ks < K)[None, :], other=0.0)
        tile = _tile(w, s, k0, K, cols, col_ok, stride_wk, stride_wn, stride_sk, one, WEIGHTS, BLOCK_K, BLOCK_N)
        acc += tl.dot(h, tile.to(h.dtype), input_precision=PRECISION)
    if WEIGHTS == INT8:
        acc *= tl.load(s + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + expert * stride_be + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    routing = tl.load(routing_ptr + pairs, mask=pair_ok, other=0.0).to(tl.float32)
    mask = pair_ok[:, None] & col_ok[None, :]
    tl.store(out_ptr + pairs[:, None] * N + cols[None, :], acc * routing[:, None], mask=mask)


def align(expert_ids: torch.Tensor, experts: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """_align's (sorted pairs, block experts) for flat int32 expert ids, blocks of `rows` pairs. The
    blocks are as many as the most any routing can use: each expert with pairs wastes at most rows - 1 padding rows."""
    pairs = expert_ids.numel()
    max_blocks = triton.cdiv(pairs + min(experts, pairs) * (rows - 1), rows)
    device = expert_ids.device
    sorted_pairs = torch.empty(max_blocks * rows, dtype=torch.int32, device=device)
    block_expert = torch.empty(max_blocks, dtype=torch.int32, device=device)
    chunk = min(ALIGN_CHUNK, max(16, triton.next_power_of_2(pairs)))
    _align[(1,)](
        expert_ids, sorted_pairs, block_expert, pairs, max_blocks,
        BLOCK_M=rows, BLOCK_E=triton.next_power_of_2(experts), CHUNK=chunk, FILL=FILL_CHUNK, num_warps=4,
    )  # fmt: skip
    return sorted_pairs, block_expert


def _strides(weight: torch.Tensor, transposed: bool) -> tuple[int, int, int]:
    """(expert, input, output) strides of an experts weight: [E, out, in], or [E, in, out] when `transposed`."""
    expert, first, second = weight.stride()
    return (expert, first, second) if transposed else (expert, second, first)


def _projection(experts: torch.nn.Module, name: str) -> tuple[torch.Tensor, torch.Tensor, tuple[int, ...], int]:
    """The kernels' view of one projection ("gate_up_proj" or "down_proj"): its weights, its scales (the weights
    again where it has none), the strides (expert, input, output of the weights; expert, group of the scales) and
    how the weights are held."""
    mode = getattr(experts, "quantized_experts", None)
    if mode is None:
        weight = getattr(experts, name)
        return weight, weight, (*_strides(weight, experts.is_transposed), 0, 0), FLOAT
    codes, scales = getattr(experts, f"{name}_codes"), getattr(experts, f"{name}_scales")
    if mode == "int8":  # codes [E, out, in], scales [E, out]
        return codes, scales, (codes.stride(0), 1, codes.stride(1), scales.stride(0), 0), INT8
    # int4: words [E, in / 8, out], scale-and-zero pairs as int32 [E, in / 32, out]
    return codes, scales, (codes.stride(0), codes.stride(1), 1, scales.stride(0), scales.stride(1)), INT4


def fused_experts_forward(
    self: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """An ExpertsInterface forward: the sum over each token's routed experts of weight * expert(token)."""
    tokens, hidden = hidden_states.shape
    top_k = top_k_index.shape[-1]
    pairs, width = tokens * top_k, self.fused_width
    rows = block_rows(pairs, self.num_experts)
    sorted_pairs, block_expert = align(top_k_index.reshape(-1).to(torch.int32), self.num_experts, rows)
    x = hidden_states.contiguous()
    precision = "ieee" if x.dtype == torch.float32 else "tf32"  # float32 stays float32 (tf32: the tensor cores')
    bucket = triton.next_power_of_2(pairs)
    # gate and up: gpt-oss's float weights interleave them (gate j at column 2j, up at 2j + 1), every other model's
    # and quantized weights hold all gates and then all ups; the biases as their weights
    interleaved = self.fused_activation == CLAMPED_SWIGLU and getattr(self, "quantized_experts", None) is None
    gate_step, up_offset = (2, 1) if interleaved else (1, width)
    weights, scales, strides, kind = _projection(self, "gate_up_proj")
    bias = self.gate_up_proj_bias if self.has_bias else weights
    gated = torch.empty(pairs, width, dtype=x.dtype, device=x.device)
    grid = lambda meta: (block_expert.numel(), triton.cdiv(width, meta["BLOCK_N"]))  # noqa: E731
    _experts_up[grid](
        x, weights, scales, bias, gated, sorted_pairs, block_expert, pairs, width, hidden, bucket, *strides,
        bias.stride(0), gate_step, up_offset, getattr(self, "alpha", 0.0), getattr(self, "limit", 0.0), FLOAT_ONE,
        TOP_K=top_k, HAS_BIAS=self.has_bias, ACTIVATION=self.fused_activation, WEIGHTS=kind, PRECISION=precision,
        BLOCK_M=rows,
    )  # fmt: skip
    weights, scales, strides, kind = _projection(self, "down_proj")
    bias = self.down_proj_bias if self.has_bias else weights
    out = torch.empty(pairs, hidden, dtype=torch.float32, device=x.device)
    grid = lambda meta: (block_expert.numel(), triton.cdiv(hidden, meta["BLOCK_N"]))  # noqa: E731
    _experts_down[grid](
        gated, weights, scales, bias, top_k_weights.reshape(-1).contiguous(), out, sorted_pairs, block_expert, pairs,
        hidden, width, bucket, *strides, bias.stride(0), FLOAT_ONE,
        HAS_BIAS=self.has_bias, WEIGHTS=kind, PRECISION=precision, BLOCK_M=rows,
    )  # fmt: skip
    return out.view(tokens, top_k, hidden).sum(dim=1).to(hidden_states.dtype)


def fused_activation(experts: torch.nn.Module) -> int | None:
    """The activation _experts_up applies for this experts module, or None where it has none of them (or a norm after
    each expert): such a model keeps transformers' own experts. transformers' default gate splits gate and up as
    halves (all gates, then all ups), gpt-oss's takes them interleaved."""
    if not getattr(experts, "has_gate", False) or getattr(experts, "has_post_expert_norm", False):
        return None
    if type(experts)._apply_gate is _default_apply_gate:
        return SILU if isinstance(getattr(experts, "act_fn", None), SILU_MODULES) else None
    if type(experts).__name__ == "GptOssExperts":
        return CLAMPED_SWIGLU
    return None


def experts_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's experts modules: those that transformers' ExpertsInterface dispatches."""
    return [m for m in model.modules() if hasattr(m, "has_gate") and isinstance(getattr(m, "num_experts", None), int)]


def use_fused_experts(model: torch.nn.Module) -> int:
    """Run the model's experts modules by the fused kernels where every one of them has an activation they compute
    (the implementation is the model's config's, one for all layers); how many modules that is (0: left as they are)."""
    modules = experts_modules(model)
    if modules and all(hasattr(m, "fused_activation") for m in modules):
        return len(modules)  # installed already (quantize_experts does it first)
    activations = [fused_activation(module) for module in modules]
    if not modules or None in activations or not hasattr(model, "set_experts_implementation"):
        return 0
    ALL_EXPERTS_FUNCTIONS.register(NAME, fused_experts_forward)
    for module, activation in zip(modules, activations, strict=True):
        module.fused_activation = activation
        down = module.down_proj
        module.fused_width = down.shape[1] if module.is_transposed else down.shape[2]
    model.set_experts_implementation(NAME)
    return len(modules)


def quantize_experts(model: torch.nn.Module, mode: str) -> int:
    """The experts' weights as int8 (one scale per output row) or int4 (groups of 32 inputs), in the layouts and
    arithmetic of the dense layers' kernels (layers/quantize.py, kernels/cuda_weight_only.py), gate and up held as all
    gates then all ups (gpt-oss's interleaved columns and biases reordered); installs the fused experts, which read
    them. How many modules that is: 0 where the fused experts do not serve the model, or (int4) an expert's inputs
    do not split into groups of 32; their weights then stay as they are."""
    modules = experts_modules(model)
    if not use_fused_experts(model) or (mode == "int4" and any(m.fused_width % 32 or _hidden(m) % 32 for m in modules)):
        return 0
    for module in modules:
        for name in ("gate_up_proj", "down_proj"):
            weight = getattr(module, name).detach()
            weight = weight.transpose(1, 2) if module.is_transposed else weight  # [E, out, in]
            if name == "gate_up_proj" and module.fused_activation == CLAMPED_SWIGLU:
                weight = torch.cat([weight[:, 0::2], weight[:, 1::2]], dim=1)
                if module.has_bias:
                    bias = module.gate_up_proj_bias.detach()
                    module.gate_up_proj_bias = torch.nn.Parameter(torch.cat([bias[:, 0::2], bias[:, 1::2]], dim=1))
            if mode == "int8":
                hold(module, name, "int8", *_int8_experts(weight))
            else:
                groups = [int4_affine(expert) for expert in weight]
                hold(module, name, "int4", *pack_int4_experts(*zip(*groups, strict=True)))
    return len(modules)


def hold(experts: torch.nn.Module, name: str, mode: str, codes: torch.Tensor, scales: torch.Tensor) -> None:
    """The projection `name` of an experts module held as `mode` codes and scales (as _projection reads them) in
    place of its float weight."""
    delattr(experts, name)
    experts.register_buffer(f"{name}_codes", codes)
    experts.register_buffer(f"{name}_scales", scales)
    experts.quantized_experts = mode


def _hidden(experts: torch.nn.Module) -> int:
    down = experts.down_proj
    return down.shape[2] if experts.is_transposed else down.shape[1]


def _int8_experts(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[E, out, in] -> int8 codes [E, out, in] and a scale per output row [E, out] (dequant.int8_per_row)."""
    experts, outputs, inputs = weight.shape
    codes, scales = int8_per_row(weight.reshape(experts * outputs, inputs), KERNEL_DTYPE)
    return codes.reshape(experts, outputs, inputs), scales.reshape(experts, outputs)


def pack_int4_experts(
    codes: Sequence[torch.Tensor], scales: Sequence[torch.Tensor], zeros: Sequence[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each expert's codes [out, in] (0..15) and scales and zeros [out, in / 32], w = (q - 8) scale + zero ->
    int4 words [E, in / 8, out] and scale-and-zero pairs as int32 [E, in / 32, out] (cuda_weight_only.pack_int4's
    layout; the scales and zeros rounded to bfloat16, as the dense layers' are)."""
    words = torch.stack([pack_int4(expert) for expert in codes])
    pairs = torch.stack([torch.stack([s.T, z.T], dim=-1) for s, z in zip(scales, zeros, strict=True)])
    return words, pairs.to(torch.bfloat16).contiguous().view(torch.int32)[..., 0]
