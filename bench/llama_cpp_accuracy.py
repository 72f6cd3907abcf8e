"""The worker's model against llama.cpp on the same GGUF file: last-position logits on 3 prompts, greedy text of 64
tokens on each, and perplexity over a fixed text; every model is also set against the float32 dequantized model (the
file's weights exactly, computed in float32), which tells how far each side is from the weights it was given.

    python bench/llama_cpp_accuracy.py [--model demo] [--threads 2] [--text-file FILE ...]

Needs llama-cpp-python (the `bench` extra). Both sides get the same token ids (no tokenizer in between). Prints a
table and writes bench/results/llama_cpp_accuracy.json. `--text-file` adds the perplexity over each file's first
TEXT_FILE_TOKENS tokens: the fixed text is 158 tokens, short enough for the ratio between two models to move by a
few percent from one text to the next.
"""

import argparse
import json
import platform
import tempfile
from pathlib import Path

import numpy as np
import torch

from rbee_worker.benchmark.accuracy import (
    GREEDY_TOKENS,
    PROMPTS,
    TEXT,
    Logits,
    first_divergence,
    greedy,
    llama_cpp_logits,
    perplexity,
    torch_logits,
    write_float32_copy,
)
from rbee_worker.hardware.devices import resolve_placement
from rbee_worker.layers.cpu_linear import can_pack, pack_linears
from rbee_worker.loading.loader import load_model, resolve_model_path

TEXT_FILE_TOKENS = 1024  # within the 2048-token context both sides get


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="demo")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--text-file", type=Path, action="append", default=[])
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    path = resolve_model_path(args.model)
    reference = load_model(str(path), resolve_placement("cpu", "float32"))
    tokenizer = reference.tokenizer
    int4 = load_model(str(path), resolve_placement("cpu", "bfloat16"), quantize="int4").model
    bf16 = load_model(str(path), resolve_placement("cpu", "bfloat16")).model
    for model in (int4, bf16):  # as the engine serves them
        if can_pack(model):
            pack_linears(model)
    float32_file = write_float32_copy(path, Path(tempfile.mkdtemp()) / "float32.gguf")
    systems: dict[str, Logits] = {
        "fp32": torch_logits(reference.model),
        "rbee int4": torch_logits(int4),
        "rbee bf16": torch_logits(bf16),
        "llama.cpp": llama_cpp_logits(path, args.threads),
        "llama.cpp on F32 copy": llama_cpp_logits(float32_file, args.threads, float32_cache=True),
    }
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS]
    text = tokenizer(TEXT)["input_ids"]
    result: dict = {"model": str(path), "machine": platform.processor() or platform.machine(), "text_tokens": len(text)}
    last = {name: [run(p)[-1] for p in prompts] for name, run in systems.items()}
    scale = max(float(np.abs(x).max()) for x in last["fp32"])
    result["logit_scale"] = scale
    result["max_abs_logit_error"] = {
        f"{a} vs {b}": [float(np.abs(x - y).max()) for x, y in zip(last[a], last[b], strict=True)]
        for a, b in (
            ("rbee int4", "llama.cpp"),
            ("rbee int4", "fp32"),
            ("llama.cpp", "fp32"),
            ("rbee bf16", "fp32"),
            ("llama.cpp on F32 copy", "fp32"),
        )
    }
    result["greedy"] = {}
    greedy_systems = ("rbee int4", "fp32", "llama.cpp", "llama.cpp on F32 copy")
    texts = {name: [greedy(systems[name], p, GREEDY_TOKENS) for p in prompts] for name in greedy_systems}
    for name in ("rbee int4", "fp32", "llama.cpp on F32 copy"):
        rows = []
        for (ours, our_gaps), (theirs, their_gaps) in zip(texts[name], texts["llama.cpp"], strict=True):
            first = first_divergence(ours, theirs)
            rows.append(
                {
                    "identical": first is None,
                    "first_divergence": first,
                    "top2_gaps_there": None if first is None else (our_gaps[first], their_gaps[first]),
                }
            )
        result["greedy"][f"{name} vs llama.cpp"] = rows
    result["perplexity"] = {name: perplexity(run, text) for name, run in systems.items()}
    ppl = result["perplexity"]
    result["perplexity_ratio_int4_vs_llama_cpp"] = ppl["rbee int4"] / ppl["llama.cpp"]
    for file in args.text_file:
        ids = tokenizer(file.read_text())["input_ids"][:TEXT_FILE_TOKENS]
        ppl = {name: perplexity(run, ids) for name, run in systems.items()}
        result.setdefault("perplexity_text_files", {})[file.name] = {
            "tokens": len(ids), "perplexity": ppl, "ratio_int4_vs_llama_cpp": ppl["rbee int4"] / ppl["llama.cpp"]
        }  # fmt: skip
    print(json.dumps(result, indent=2))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "llama_cpp_accuracy.json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
