"""The llama.cpp figures that rbee-worker's llama.cpp runtime is held against (issue 21), with no HTTP in between:

- llama-cpp-python's own streaming generate of one sequence (`Llama.create_completion(stream=True)`), decode tok/s
  greedy and at temperature 0.7 / top_p 0.9, and the time to first token of a 512-token prompt (the same peer as
  `rbee-worker bench --peers llama.cpp`: benchmark/peers.py);
- a bare `llama_decode` loop over 16 sequences (and over 1), aggregate tok/s: one context with a sequence each (as the
  worker's runner sets it up), all prompts in one batch, then one batch per step of one token per sequence, each the
  argmax of its logits on the host. This is llama.cpp's batched decode without any serving around it.

    python bench/llama_cpp_batch.py [--model demo] [--threads 2] [--streams 16] [--gen-tokens 128] [--repeats 3]

Needs llama-cpp-python. Prints a table and writes bench/results/llama_cpp/llama_cpp_batch_<cpu>.json with the CPU's
name and flags (lscpu).
"""

import argparse
import ctypes
import json
import re
import statistics
import subprocess
import time
from pathlib import Path
from types import SimpleNamespace

import llama_cpp
import llama_cpp.llama_cpp as native
import numpy as np

from rbee_worker.benchmark.peers import SAMPLING, run_llama_cpp
from rbee_worker.benchmark.run import build_spec, cpu_name
from rbee_worker.models.llama_cpp_model import has_amx

OUT = Path(__file__).parent / "results" / "llama_cpp"


@native.llama_log_callback
def _quiet(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
    """llama.cpp's messages, dropped: the table is the output."""


def bare_decode(path: str, threads: int, prompts: list[list[int]], tokens: int) -> float:
    """Aggregate tok/s of `tokens` greedy decode steps over len(prompts) sequences, after one batch of all prompts."""
    params = native.llama_model_default_params()
    params.n_gpu_layers = 0
    params.use_extra_bufts = not has_amx()  # AMX buffers crash on batches of several tokens (models/llama_cpp_model)
    model = native.llama_model_load_from_file(path.encode(), params)
    vocab = native.llama_vocab_n_tokens(native.llama_model_get_vocab(model))
    streams, longest = len(prompts), max(len(p) for p in prompts)
    context_params = native.llama_context_default_params()
    context_params.n_seq_max = streams
    context_params.n_ctx = streams * (longest + tokens + 256)
    context_params.kv_unified = False
    context_params.n_batch = context_params.n_ubatch = max(sum(len(p) for p in prompts), streams)
    context_params.n_threads = context_params.n_threads_batch = threads
    context = native.llama_init_from_model(model, context_params)
    batch = native.llama_batch_init(context_params.n_batch, 0, 1)

    def step(rows: list[tuple[int, list[int], int]]) -> list[int]:
        """Feed each (sequence, tokens, first position); the argmax of each sequence's last logits."""
        n = 0
        for seq, ids, start in rows:
            for i, token in enumerate(ids):
                batch.token[n], batch.pos[n], batch.n_seq_id[n] = token, start + i, 1
                batch.seq_id[n][0], batch.logits[n] = seq, i == len(ids) - 1
                n += 1
        batch.n_tokens = n
        if (code := native.llama_decode(context, batch)) != 0:
            raise RuntimeError(f"llama_decode returned {code}")
        address = ctypes.cast(native.llama_get_logits(context), ctypes.c_void_p).value
        logits = np.ctypeslib.as_array((ctypes.c_float * (len(rows) * vocab)).from_address(address))
        return logits.reshape(len(rows), vocab).argmax(1).tolist()

    try:
        last = step([(s, p, 0) for s, p in enumerate(prompts)])
        started = time.perf_counter()
        for t in range(tokens):
            last = step([(s, [last[s]], len(p) + t) for s, p in enumerate(prompts)])
        return streams * tokens / (time.perf_counter() - started)
    finally:
        native.llama_batch_free(batch)
        native.llama_free(context)
        native.llama_model_free(model)


def cpu_flags() -> list[str]:
    try:
        output = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return []
    line = next((line for line in output.splitlines() if line.startswith("Flags:")), "Flags:")
    return line.split(":", 1)[1].split()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="demo")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--gen-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    native.llama_log_set(_quiet, ctypes.c_void_p())
    spec_args = SimpleNamespace(
        model=args.model, prompt_tokens=args.prompt_tokens, concurrency=[args.streams], gen_tokens=args.gen_tokens,
        repeats=args.repeats, threads=args.threads, sampling="greedy",
    )  # fmt: skip
    spec = build_spec(spec_args)
    peer_args = SimpleNamespace(model=spec_args.model_path)
    result: dict = {
        "cpu": cpu_name(),
        "cpu_flags": cpu_flags(),
        "llama_cpp_python": llama_cpp.__version__,
        "llama_cpp_system": native.llama_print_system_info().decode().strip(),
        "model": args.model,
        "threads": args.threads,
        "gen_tokens": args.gen_tokens,
        "prompt_tokens": len(spec["long_prompt"]),
    }
    for name, sampling in SAMPLING.items():
        result[f"generate_{name}"] = run_llama_cpp(peer_args, {**spec, "sampling": sampling})
    prompts = [spec["short_prompt"] + [i] for i in spec["distinct_ids"][: args.streams]]
    for streams in (1, args.streams):
        runs = [bare_decode(spec_args.model_path, args.threads, prompts[:streams], args.gen_tokens)
                for _ in range(args.repeats)]  # fmt: skip
        result[f"bare_decode_{streams}_tok_s"] = {"median": statistics.median(runs), "runs": runs}
    rows = [
        ("generate, greedy: decode tok/s", result["generate_greedy"]["decode_tok_s"]),
        ("generate, temperature 0.7 / top_p 0.9: decode tok/s", result["generate_chat"]["decode_tok_s"]),
        (f"time to first token, {result['prompt_tokens']}-token prompt (s)", result["generate_greedy"]["ttft_s"]),
        ("bare llama_decode, 1 sequence: tok/s", result["bare_decode_1_tok_s"]["median"]),
        (f"bare llama_decode, {args.streams} sequences: aggregate tok/s",
         result[f"bare_decode_{args.streams}_tok_s"]["median"]),
    ]  # fmt: skip
    print(f"llama.cpp on {result['cpu']}, {args.threads} threads, {args.model}")
    for label, value in rows:
        print(f"  {label:<60} {value:8.2f}")
    OUT.mkdir(parents=True, exist_ok=True)
    path = OUT / f"llama_cpp_batch_{re.sub(r'[^A-Za-z0-9]+', '_', result['cpu']).strip('_')}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
