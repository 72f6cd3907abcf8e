"""How llama.cpp's logits for one prompt move with what else its context holds and how the prompt is split: the
largest change of any logit of the prompt's last token against the prompt computed alone, at once, in a fresh context.

Cases (llama.cpp's low-level API, one unified KV pool unless named): the same again (a control); another sequence's
cells present first; a split at every suffix length in --suffixes (the prefix in one llama_decode, the rest in
another); the prefix's state saved with llama_state_seq_get_data, restored into an empty context's sequence and cut
(the worker's prompt cache); the same with another sequence present; and the per-sequence streams of
`--deterministic` with another sequence present. Prints a table and saves JSON.

    PYTHONPATH=src python bench/llama_cpp_numerics.py --model demo --threads 2
"""

import argparse
import ctypes
import json
import platform
import time
from collections.abc import Callable
from pathlib import Path

import llama_cpp.llama_cpp as native
import numpy as np

from rbee_worker.hardware.cpu_features import cpu_features
from rbee_worker.loading.loader import resolve_model_path

PROMPT = " ".join(f"The bee number {i} visits flower {i * 7 % 13} in the garden of the queen." for i in range(30))
OTHER = " ".join(f"Other text {i} about rivers and {i * 3} mountains." for i in range(25))


class Bench:
    def __init__(self, path: Path, threads: int) -> None:
        native.llama_backend_init()
        self.model = native.llama_model_load_from_file(str(path).encode(), native.llama_model_default_params())
        self.vocab = native.llama_model_get_vocab(self.model)
        self.n_vocab = native.llama_vocab_n_tokens(self.vocab)
        self.threads = threads
        self.batch = native.llama_batch_init(4096, 0, 1)

    def tokens(self, text: str) -> list[int]:
        data = text.encode()
        buffer = (native.llama_token * 4096)()
        count = native.llama_tokenize(self.vocab, data, len(data), buffer, 4096, False, False)
        return list(buffer[:count])

    def context(self, unified: bool = True) -> ctypes.c_void_p:
        params = native.llama_context_default_params()
        params.n_ctx, params.n_seq_max, params.kv_unified = 4096, 4, unified
        params.n_batch = params.n_ubatch = 2048
        params.n_threads = params.n_threads_batch = self.threads
        params.no_perf = True
        return native.llama_init_from_model(self.model, params)

    def decode(self, context: ctypes.c_void_p, tokens: list[int], start: int, seq: int) -> np.ndarray:
        """The tokens at positions start.. of sequence `seq`: the logits of the last."""
        for i, token in enumerate(tokens):
            self.batch.token[i], self.batch.pos[i], self.batch.n_seq_id[i] = token, start + i, 1
            self.batch.seq_id[i][0], self.batch.logits[i] = seq, i == len(tokens) - 1
        self.batch.n_tokens = len(tokens)
        if native.llama_decode(context, self.batch) != 0:
            raise RuntimeError("llama_decode failed")
        address = ctypes.cast(native.llama_get_logits(context), ctypes.c_void_p).value
        return np.frombuffer((ctypes.c_float * self.n_vocab).from_address(address), dtype=np.float32).copy()

    def run(self, case: Callable[[ctypes.c_void_p], np.ndarray], unified: bool = True) -> np.ndarray:
        context = self.context(unified)
        try:
            return case(context)
        finally:
            native.llama_free(context)


def saved(bench: Bench, context: ctypes.c_void_p, tokens: list[int], seq: int) -> bytearray:
    """The state of `tokens` computed in sequence `seq`, as llama.cpp saves it; the sequence then emptied."""
    bench.decode(context, tokens, 0, seq)
    size = native.llama_state_seq_get_size(context, seq)
    state = bytearray(size)
    native.llama_state_seq_get_data(context, (ctypes.c_ubyte * size).from_buffer(state), size, seq)
    native.llama_memory_seq_rm(native.llama_get_memory(context), seq, -1, -1)
    return state


def restored(bench: Bench, prompt: list[int], other: list[int], cut: int, beside: bool) -> Callable:
    """A state saved for the prompt's first `cut` tokens and more (then other tokens), restored into sequence 0 and cut
    at `cut`, the rest computed; `beside`: another sequence holds cells meanwhile."""

    def case(context: ctypes.c_void_p) -> np.ndarray:
        state = saved(bench, context, prompt[:cut] + other[:64], 1)
        if beside:
            bench.decode(context, other[:50], 0, 2)
        native.llama_state_seq_set_data(context, (ctypes.c_ubyte * len(state)).from_buffer(state), len(state), 0)
        native.llama_memory_seq_rm(native.llama_get_memory(context), 0, cut, -1)
        return bench.decode(context, prompt[cut:], cut, 0)

    return case


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="demo")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--suffixes", type=int, nargs="+", default=[1, 8, 32, 63, 64, 128, 256])
    parser.add_argument("--out", type=Path, default=Path(f"llama-cpp-numerics-{time.strftime('%Y%m%d-%H%M%S')}.json"))
    args = parser.parse_args()
    bench = Bench(resolve_model_path(args.model), args.threads)
    prompt, other = bench.tokens(PROMPT), bench.tokens(OTHER)
    fresh = bench.run(lambda c: bench.decode(c, prompt, 0, 0))
    cut = len(prompt) // 2
    cases: dict[str, Callable] = {
        "the same again": lambda c: bench.decode(c, prompt, 0, 0),
        "another sequence's cells first": lambda c: (bench.decode(c, other, 0, 1), bench.decode(c, prompt, 0, 0))[1],
    }
    for n in args.suffixes:
        cases[f"split, last {n} tokens apart"] = lambda c, n=n: (
            bench.decode(c, prompt[:-n], 0, 0),
            bench.decode(c, prompt[-n:], len(prompt) - n, 0),
        )[1]
    cases[f"restored state cut at {cut}"] = restored(bench, prompt, other, cut, beside=False)
    cases[f"restored state cut at {cut}, another sequence beside"] = restored(bench, prompt, other, cut, beside=True)
    rows = {name: float(np.abs(bench.run(case) - fresh).max()) for name, case in cases.items()}
    streams = bench.run(lambda c: bench.decode(c, prompt, 0, 0), unified=False)
    rows["streams: another sequence's cells first"] = float(
        np.abs(
            bench.run(lambda c: (bench.decode(c, other, 0, 1), bench.decode(c, prompt, 0, 0))[1], unified=False)
            - streams
        ).max()
    )
    features = cpu_features()
    print(f"{len(prompt)}-token prompt, {platform.processor() or platform.machine()}, {features}")
    print("| case | max abs logit change |\n|---|---|")
    for name, change in rows.items():
        print(f"| {name} | {change:.4g} |")
    args.out.write_text(json.dumps({"prompt_tokens": len(prompt), "cpu": str(features), "cases": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
