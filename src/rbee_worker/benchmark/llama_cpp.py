"""llama-cpp-python, opened the same way for the benchmark's peer and the accuracy checks.

On CPUs with AMX (Intel Xeon since Sapphire Rapids), llama.cpp repacks the quantized matrices into its AMX buffers at
load. There, with llama-cpp-python 0.3.36, every batch of more than one token crashes the process (SIGSEGV in
llama_decode; llama.cpp issue 20824 reports the same crash in `ggml_backend_amx_mul_mat`), while one-token batches run,
much faster than from ggml's plain CPU buffers (bench/results/README.md). `plain_buffers=True` is llama.cpp's
`--no-repack`: every matrix stays in ggml's plain CPU buffers, where batches of any size run. Elsewhere both load the
same buffers.

`batched_decode` is llama.cpp's batched decode of several sequences, the figure the worker's llama.cpp runtime is
held against at each concurrency.
"""

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rbee_worker.loading.gguf.llama_cpp_model import has_amx

if TYPE_CHECKING:
    from llama_cpp import Llama

__all__ = ["BatchedDecode", "batched_decode", "has_amx", "open_llama"]


def open_llama(path: str, *, plain_buffers: bool, **kwargs: Any) -> "Llama":
    """`Llama(model_path=path, **kwargs)`, with the matrices in ggml's plain CPU buffers if `plain_buffers`."""
    import llama_cpp.llama_cpp as native
    from llama_cpp import Llama

    if not plain_buffers:
        return Llama(model_path=path, **kwargs)
    # Llama() takes its model parameters from this function and exposes no argument for `use_extra_bufts`.
    defaults = native.llama_model_default_params

    def plain() -> native.llama_model_params:
        params = defaults()
        params.use_extra_bufts = False
        return params

    native.llama_model_default_params = plain
    try:
        return Llama(model_path=path, **kwargs)
    finally:
        native.llama_model_default_params = defaults


@dataclass(frozen=True)
class BatchedDecode:
    """What `batched_decode` measured."""

    aggregate_tok_s: float  # over every token from the prompts' batch to the last step (what the worker's covers)
    decode_aggregate_tok_s: float  # over the decode steps alone
    tokens: list[list[int]]  # each sequence's tokens


def batched_decode(
    path: str, threads: int | None, prompts: list[list[int]], tokens: int, sampling: dict | None = None
) -> BatchedDecode:
    """llama.cpp's own batched decode, with no serving around it: `tokens` tokens for each of len(prompts) sequences.
    One context with a KV sequence per prompt (not unified, as the worker's llama.cpp runtime sets it up), all prompts
    in one batch (which gives each sequence its first token), then one `llama_decode` per step of one token per
    sequence. Each token is the argmax of its logits on the host, or, where `sampling` has a temperature above 0,
    drawn by a llama.cpp sampler chain of the sequence's own (top-p, temperature, then the draw: the order and the
    samplers of llama-cpp-python's generate, seeded with the sequence's index), so a sampled run pays llama.cpp's own
    sampling cost."""
    import ctypes

    import llama_cpp.llama_cpp as native
    import numpy as np

    params = native.llama_model_default_params()
    params.n_gpu_layers = 0
    params.use_extra_bufts = not has_amx()  # AMX buffers crash on batches of several tokens (see above)
    model = native.llama_model_load_from_file(path.encode(), params)
    if not model:
        raise RuntimeError(f"llama.cpp cannot load {path}")
    vocab = native.llama_vocab_n_tokens(native.llama_model_get_vocab(model))
    streams, longest = len(prompts), max(len(p) for p in prompts)
    context_params = native.llama_context_default_params()
    context_params.n_seq_max = streams
    context_params.n_ctx = streams * (longest + tokens + 256)
    context_params.kv_unified = False
    context_params.n_batch = context_params.n_ubatch = max(sum(len(p) for p in prompts), streams)
    if threads:
        context_params.n_threads = context_params.n_threads_batch = threads
    context = native.llama_init_from_model(model, context_params)
    if not context:
        native.llama_model_free(model)
        raise RuntimeError(f"llama.cpp cannot create a context of {streams} sequences")
    batch = native.llama_batch_init(context_params.n_batch, 0, 1)
    sampled = sampling is not None and sampling["temperature"] > 0
    samplers = [_sampler_chain(sampling, seq) for seq in range(streams)] if sampled else []

    def step(rows: list[tuple[int, list[int], int]]) -> list[int]:
        """Feed each (sequence, tokens, first position); the token chosen from each sequence's last logits."""
        n, last = 0, []
        for seq, ids, start in rows:
            for i, token in enumerate(ids):
                batch.token[n], batch.pos[n], batch.n_seq_id[n] = token, start + i, 1
                batch.seq_id[n][0], batch.logits[n] = seq, i == len(ids) - 1
                n += 1
            last.append(n - 1)
        batch.n_tokens = n
        if (code := native.llama_decode(context, batch)) != 0:
            raise RuntimeError(f"llama_decode returned {code}")
        if samplers:
            seqs = [seq for seq, _, _ in rows]
            return [native.llama_sampler_sample(samplers[seq], context, i) for seq, i in zip(seqs, last, strict=True)]
        address = ctypes.cast(native.llama_get_logits(context), ctypes.c_void_p).value
        logits = np.ctypeslib.as_array((ctypes.c_float * (len(rows) * vocab)).from_address(address))
        return logits.reshape(len(rows), vocab).argmax(1).tolist()

    try:
        started = time.perf_counter()
        chosen = [step([(s, p, 0) for s, p in enumerate(prompts)])]
        decoding = time.perf_counter()
        for t in range(tokens - 1):
            chosen.append(step([(s, [chosen[-1][s]], len(p) + t) for s, p in enumerate(prompts)]))
        ended = time.perf_counter()
        return BatchedDecode(
            streams * tokens / (ended - started),
            streams * (tokens - 1) / (ended - decoding),
            [list(sequence) for sequence in zip(*chosen, strict=True)],
        )
    finally:
        for sampler in samplers:
            native.llama_sampler_free(sampler)
        native.llama_batch_free(batch)
        native.llama_free(context)
        native.llama_model_free(model)


def _sampler_chain(sampling: dict, seed: int) -> Any:
    """A llama.cpp sampler chain for `sampling` (temperature, top_p), in llama-cpp-python's order: top-p over the
    untempered probabilities, then the temperature, then the draw."""
    import llama_cpp.llama_cpp as native

    chain = native.llama_sampler_chain_init(native.llama_sampler_chain_default_params())
    native.llama_sampler_chain_add(chain, native.llama_sampler_init_top_p(sampling["top_p"], 1))
    native.llama_sampler_chain_add(chain, native.llama_sampler_init_temp(sampling["temperature"]))
    native.llama_sampler_chain_add(chain, native.llama_sampler_init_dist(seed))
    return chain
