"""Which dtype and --quantize mode run fastest on this CPU? The measurement behind `--dtype auto` on a CPU
(cpu_features.CpuFeatures.auto_dtype).

    .venv/bin/python bench/cpu_dtype.py [--hf-dir DIR] [--repeats 3] [--threads 2] [--tokens 128]
    RBEE_CPU_ISA=avx2 .venv/bin/python bench/cpu_dtype.py ...   # as on an AVX2-only x86 CPU

For each model (the demo GGUF; with --hf-dir a safetensors directory too) and each dtype x --quantize mode, a fresh
process loads it through rbee-worker's engine and measures the time to the first token of a 512-token prompt and the
decode rate of --tokens tokens, greedy and sampled (temperature 0.7, top_p 0.9). The peer, in the same run and
process kind: transformers' own model on the same weights in the same dtype (a bare forward of the prompt, and
`generate` greedy). Prints a table (medians of --repeats) and writes JSON to bench/results/.
"""

import argparse
import contextlib
import json
import multiprocessing
import platform
import statistics
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch

from rbee_worker.engine.engine import Engine
from rbee_worker.engine.request_types import End, Request, Token
from rbee_worker.engine.sampling.sampling_params import SamplingParams
from rbee_worker.hardware.cpu_features import cpu_features
from rbee_worker.hardware.devices import resolve_placement
from rbee_worker.loading.loader import load_model

STORY = "Once upon a time, in a small village by the sea, there lived an old fisherman who told stories. "
PROMPT_TOKENS = 512
GREEDY = SamplingParams(temperature=0.0)
SAMPLED = SamplingParams(temperature=0.7, top_p=0.9)
DTYPES = ("float32", "bfloat16", "float16")


def time_to_first_token(engine: Engine, prompt: tuple[int, ...]) -> float:
    started = time.perf_counter()
    for event in engine.stream(Request(prompt, max_tokens=1, sampling=GREEDY)):
        if isinstance(event, Token):
            return time.perf_counter() - started
    raise RuntimeError("no token")


def decode_rate(engine: Engine, prompt: tuple[int, ...], tokens: int, sampling: SamplingParams) -> float:
    request = Request(prompt, max_tokens=tokens, sampling=sampling, seed=7, ignore_eos=True)
    end = next(e for e in engine.stream(request) if isinstance(e, End))
    return (end.tokens_out - 1) / end.decode_time_s


def measure_engine(model: str, dtype: str, quantize: str, tokens: int, repeats: int, threads: int) -> dict:
    """rbee-worker's engine in this (fresh) process: each system gets its own, since torch's CPU kernels run slower
    on a thread other than the one that first ran them (see engine.Engine)."""
    torch.set_num_threads(threads)
    placement = resolve_placement("cpu", dtype)
    engine = Engine(lambda: load_model(model, placement, quantize=quantize))
    try:
        prompt = engine.model.tokenize(STORY * 40)[:PROMPT_TOKENS]
        short = engine.model.tokenize(STORY)
        time_to_first_token(engine, prompt)  # warm-up: first-call kernel selection
        decode_rate(engine, short, 8, GREEDY)
        kinds = sorted({type(m).__name__ for m in engine.loaded.model.modules() if "Linear" in type(m).__name__})
        return {
            "dtype": str(placement.dtype).removeprefix("torch."),
            "linear_layers": kinds,
            "ttft_s": [time_to_first_token(engine, prompt) for _ in range(repeats)],
            "greedy_tok_s": [decode_rate(engine, short, tokens, GREEDY) for _ in range(repeats)],
            "sampled_tok_s": [decode_rate(engine, short, tokens, SAMPLED) for _ in range(repeats)],
        }
    finally:
        engine.close()


def measure_transformers(model: str, dtype: str, tokens: int, repeats: int, threads: int) -> dict:
    """transformers' own model on the same weights (as the loader builds it, not packed): a bare forward of the
    prompt, and greedy `generate` of `tokens` tokens less its prefill."""
    torch.set_num_threads(threads)
    loaded = load_model(model, resolve_placement("cpu", dtype))
    prompt = torch.tensor([loaded.tokenizer(STORY * 40)["input_ids"][:PROMPT_TOKENS]])
    short = torch.tensor([loaded.tokenizer(STORY)["input_ids"]])

    def forward() -> float:
        started = time.perf_counter()
        loaded.model(prompt)
        return time.perf_counter() - started

    def generate() -> float:
        started = time.perf_counter()
        loaded.model.generate(short, max_new_tokens=1, min_new_tokens=1, do_sample=False)
        prefill = time.perf_counter() - started
        started = time.perf_counter()
        loaded.model.generate(short, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
        return (tokens - 1) / (time.perf_counter() - started - prefill)

    with torch.inference_mode():
        forward()
        return {"forward_s": [forward() for _ in range(repeats)], "greedy_tok_s": [generate() for _ in range(repeats)]}


def in_fresh_process(function, *args) -> dict:
    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(function, *args).result()


def median(values: list[float], digits: int) -> float:
    return round(statistics.median(values), digits)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hf-dir", type=Path, help="a safetensors model directory, measured next to the demo GGUF")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args()

    cpu = cpu_features()
    models = {"demo": ["auto", "none"]}  # GGUF: its Q4_1 matrices kept as int4, or dequantized to the dtype
    if args.hf_dir:
        models[str(args.hf_dir)] = ["none", "int8", "int4"]
    rows = []
    for model, modes in models.items():
        for dtype in ("auto", *DTYPES):
            peer = None
            if dtype != "auto":
                peer = in_fresh_process(measure_transformers, model, dtype, args.tokens, args.repeats, args.threads)
            for quantize in modes:
                ours = in_fresh_process(measure_engine, model, dtype, quantize, args.tokens, args.repeats, args.threads)
                row = {"model": Path(model).name, "dtype_flag": dtype, "quantize": quantize, **ours}
                if peer is not None:
                    row["transformers"] = peer
                rows.append(row)
                print(f"{row['model']:<28} {dtype:<9} {quantize:<5} -> {ours['dtype']:<9} "
                      f"TTFT {median(ours['ttft_s'], 3):>6} s  greedy {median(ours['greedy_tok_s'], 1):>6} tok/s  "
                      f"sampled {median(ours['sampled_tok_s'], 1):>6} tok/s  "
                      + (f"| transformers forward {median(peer['forward_s'], 3)} s, generate "
                         f"{median(peer['greedy_tok_s'], 1)} tok/s" if peer else ""), flush=True)  # fmt: skip

    cpu_name = platform.processor() or platform.machine()
    with contextlib.suppress(OSError, StopIteration):
        cpu_name = next(
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        )
    result = {
        "what": f"engine-level: TTFT of a {PROMPT_TOKENS}-token prompt, decode of {args.tokens} tokens greedy and "
        f"sampled (temperature 0.7, top_p 0.9); transformers' model on the same weights as the peer; each in a fresh "
        f"process, {args.repeats} repeats (medians in the table)",
        "cpu": {"name": cpu_name, **cpu.describe()},
        "threads": args.threads,
        "torch": torch.__version__,
        "rows": rows,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    suffix = f"_forced_{cpu.forced}" if cpu.forced else ""
    out = args.out / f"cpu_dtype_{cpu_name.replace(' ', '_')}{suffix}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
