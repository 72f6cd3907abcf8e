"""Which dtype decodes fastest on this CPU? Chooses `--dtype auto` on CPU (devices.CPU_AUTO_DTYPE).

    .venv/bin/python bench/cpu_dtype.py [--tokens 128] [--repeats 3] [--threads 2]

For each dtype, the demo model generates greedily through rbee-worker's engine, and transformers' `generate` runs on
the same weights as the peer, each in a fresh process. Prints a table (median of the repeats) and writes JSON to
bench/results/cpu_dtype.json.
"""

import argparse
import json
import multiprocessing
import platform
import statistics
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch

from rbee_worker.devices import Placement
from rbee_worker.engine.engine import Engine
from rbee_worker.engine.sampling import SamplingParams
from rbee_worker.engine.types import End, Request
from rbee_worker.models.loader import load_model

PROMPT = "Once upon a time, in a small village by the sea,"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def engine_decode_rate(engine: Engine, prompt_ids: tuple[int, ...], tokens: int) -> float:
    request = Request(prompt_ids, max_tokens=tokens, sampling=SamplingParams(temperature=0.0))
    end = next(e for e in engine.stream(request) if isinstance(e, End))
    return (end.tokens_out - 1) / end.decode_time_s


def transformers_decode_rate(model, prompt_ids: tuple[int, ...], tokens: int) -> float:
    ids = torch.tensor([prompt_ids])
    with torch.inference_mode():
        # Time the prefill alone, then prefill + decode, so that the difference is the decode of tokens - 1 tokens.
        started = time.perf_counter()
        model.generate(ids, max_new_tokens=1, min_new_tokens=1, do_sample=False)
        prefill = time.perf_counter() - started
        started = time.perf_counter()
        model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
        return (tokens - 1) / (time.perf_counter() - started - prefill)


def measure(system: str, dtype_name: str, tokens: int, repeats: int, threads: int) -> list[float]:
    """Decode rates of one system in this (fresh) process.

    Each measurement gets its own process because torch's CPU kernels slow down by about half on one thread once
    another live thread of the process has run them (see engine.Engine), which would penalise whichever runs second.
    """
    torch.set_num_threads(threads)
    placement = Placement(torch.device("cpu"), DTYPES[dtype_name])
    if system == "rbee":
        engine = Engine(lambda: load_model("demo", placement))
        prompt_ids = engine.tokenize(PROMPT)
        engine_decode_rate(engine, prompt_ids, 8)  # warm-up: first-call kernel selection
        rates = [engine_decode_rate(engine, prompt_ids, tokens) for _ in range(repeats)]
        engine.close()
        return rates
    loaded = load_model("demo", placement)
    prompt_ids = tuple(loaded.tokenizer(PROMPT)["input_ids"])
    transformers_decode_rate(loaded.model, prompt_ids, 8)
    return [transformers_decode_rate(loaded.model, prompt_ids, tokens) for _ in range(repeats)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args()

    rows = []
    spawn = multiprocessing.get_context("spawn")
    for name in DTYPES:
        rates = {}
        for system in ("rbee", "transformers"):
            with ProcessPoolExecutor(max_workers=1, mp_context=spawn) as pool:
                rates[system] = pool.submit(measure, system, name, args.tokens, args.repeats, args.threads).result()
        rows.append(
            {
                "dtype": name,
                "rbee_decode_tok_s": round(statistics.median(rates["rbee"]), 1),
                "transformers_generate_tok_s": round(statistics.median(rates["transformers"]), 1),
                "rbee_runs": [round(r, 1) for r in rates["rbee"]],
                "transformers_runs": [round(r, 1) for r in rates["transformers"]],
            }
        )

    print(f"{'dtype':<10} {'rbee tok/s':>11} {'transformers tok/s':>19} {'ratio':>6}")
    for row in rows:
        ratio = row["rbee_decode_tok_s"] / row["transformers_generate_tok_s"]
        print(
            f"{row['dtype']:<10} {row['rbee_decode_tok_s']:>11} {row['transformers_generate_tok_s']:>19} {ratio:>6.2f}"
        )
    result = {
        "what": f"demo model (SmolLM2-135M Q4_1 dequantized), greedy decode of {args.tokens} tokens, median of "
        f"{args.repeats}",
        "machine": f"{platform.node()} {platform.processor() or platform.machine()}, {args.threads} torch threads",
        "torch": torch.__version__,
        "rows": rows,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "cpu_dtype.json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
