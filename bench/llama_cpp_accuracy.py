"""The worker's model against llama.cpp on the same GGUF file: last-position logits on 3 prompts, greedy text of 64
tokens on each, and perplexity over a fixed text; every model is also set against the float32 dequantized model (the
file's weights exactly, computed in float32), which tells how far each side is from the weights it was given.

    python bench/llama_cpp_accuracy.py [--model demo] [--threads 2]

Needs llama-cpp-python (the `bench` extra). Both sides get the same token ids (no tokenizer in between). Prints a
table and writes bench/results/llama_cpp_accuracy.json.
"""

import argparse
import json
import math
import platform
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from rbee_worker.devices import resolve_placement
from rbee_worker.engine.cpu_linear import can_pack, pack_linears
from rbee_worker.models.loader import load_model, resolve_model_path

PROMPTS = ("The capital of France is", "def fibonacci(n):\n", "Once upon a time, in a small village by the sea,")
# A fixed text for perplexity (the opening of the Python tutorial's introduction, public domain-like prose).
TEXT = (
    "Python is an easy to learn, powerful programming language. It has efficient high-level data structures and a "
    "simple but effective approach to object-oriented programming. Python's elegant syntax and dynamic typing, "
    "together with its interpreted nature, make it an ideal language for scripting and rapid application development "
    "in many areas on most platforms. The Python interpreter and the extensive standard library are freely available "
    "in source or binary form for all major platforms from the Python web site, and may be freely distributed. The "
    "same site also contains distributions of and pointers to many free third party Python modules, programs and "
    "tools, and additional documentation. The Python interpreter is easily extended with new functions and data "
    "types implemented in C or C++ (or other languages callable from C). Python is also suitable as an extension "
    "language for customizable applications."
)
GREEDY_TOKENS = 64

Logits = Callable[[list[int]], np.ndarray]  # token ids -> (len(ids), vocab) float32 logits, every position


def torch_logits(model: torch.nn.Module) -> Logits:
    def run(ids: list[int]) -> np.ndarray:
        with torch.inference_mode():
            return model(input_ids=torch.tensor([ids]), use_cache=False).logits[0].float().numpy()

    return run


def llama_cpp_logits(path: Path, threads: int) -> Logits:
    from llama_cpp import Llama

    llm = Llama(model_path=str(path), n_ctx=2048, n_threads=threads, logits_all=True, verbose=False)

    def run(ids: list[int]) -> np.ndarray:
        llm.reset()
        llm.eval(ids)
        return np.array(llm.scores[: len(ids)], dtype=np.float32)

    return run


def write_float32_copy(path: Path, out: Path) -> Path:
    """The GGUF file with every tensor dequantized to F32 (metadata copied): llama.cpp on it computes the exact
    weights in float32, which separates its model code from its quantized kernels."""
    import gguf

    reader = gguf.GGUFReader(path)
    writer = gguf.GGUFWriter(out, arch=str(reader.fields["general.architecture"].contents()))
    for field in reader.fields.values():
        if field.name == "general.architecture" or field.name.startswith("GGUF."):
            continue
        vtype = field.types[0]
        sub_type = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), vtype, sub_type=sub_type)
    for tensor in reader.tensors:
        writer.add_tensor(tensor.name, gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def greedy(logits: Logits, prompt: list[int], tokens: int) -> tuple[list[int], list[float]]:
    """Greedy continuation (full recompute per token: slow but the same path as the logits) and each step's gap
    between the two largest logits."""
    ids, gaps = list(prompt), []
    for _ in range(tokens):
        last = logits(ids)[-1]
        top2 = np.sort(last)[-2:]
        gaps.append(float(top2[1] - top2[0]))
        ids.append(int(last.argmax()))
    return ids[len(prompt) :], gaps


def perplexity(logits: Logits, ids: list[int]) -> float:
    scores = torch.from_numpy(logits(ids)[:-1]).double()
    return math.exp(torch.nn.functional.cross_entropy(scores, torch.tensor(ids[1:])).item())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="demo")
    parser.add_argument("--threads", type=int, default=2)
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
        "llama.cpp on F32 copy": llama_cpp_logits(float32_file, args.threads),
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
            first = next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=True)) if a != b), None)
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
    print(json.dumps(result, indent=2))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "llama_cpp_accuracy.json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
