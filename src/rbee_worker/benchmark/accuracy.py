"""The worker's model set against llama.cpp on the same GGUF file (bench/llama_cpp_accuracy.py and
tests/engine/test_llama_cpp.py): logits at every position from token ids (no tokenizer in between), greedy
continuations, perplexity, and a copy of a GGUF file with every tensor dequantized to F32.

llama-cpp-python is an optional extra (`bench`, `test`); it is imported only where used.
"""

import math
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

PROMPTS = ("The capital of France is", "def fibonacci(n):\n", "Once upon a time, in a small village by the sea,")
# A fixed text for perplexity: the opening of the Python tutorial's introduction.
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

# Token ids -> (len(ids), vocab) float32 logits, every position. Both implementations keep the state of the previous
# call: ids that extend the previous ones cost only the new tokens (a greedy continuation is one token per call).
Logits = Callable[[list[int]], np.ndarray]


def torch_logits(model: torch.nn.Module) -> Logits:
    seen: list[int] = []  # the ids in the cache, and a row of logits for each
    rows: list[np.ndarray] = []
    cache = None

    def run(ids: list[int]) -> np.ndarray:
        nonlocal seen, rows, cache
        if ids[: len(seen)] != seen or len(ids) <= len(seen):
            seen, rows, cache = [], [], None
        with torch.inference_mode():
            output = model(input_ids=torch.tensor([ids[len(seen) :]]), past_key_values=cache, use_cache=True)
        cache, seen = output.past_key_values, list(ids)
        rows.extend(output.logits[0].float().numpy())
        return np.stack(rows)

    return run


def llama_cpp_logits(path: Path, threads: int, float32_cache: bool = False) -> Logits:
    """llama.cpp's logits at every position. Its KV cache holds float16 by default, as llama.cpp serves; with
    `float32_cache` float32, so that a float32 file is computed in float32 throughout (the float16 cache alone puts
    its logits up to 9e-4 of the largest off an exact float32 computation of the demo model)."""
    from rbee_worker.benchmark.llama_cpp import open_llama

    cache_type = 0 if float32_cache else 1  # ggml_type: GGML_TYPE_F32, GGML_TYPE_F16
    # ggml's plain CPU kernels: llama.cpp's reference on every machine, and the only ones that run batches where it
    # would use AMX (see llama_cpp.py).
    llm = open_llama(
        str(path),
        plain_buffers=True,
        n_ctx=2048,
        n_threads=threads,
        logits_all=True,
        verbose=False,
        type_k=cache_type,
        type_v=cache_type,
    )

    def run(ids: list[int]) -> np.ndarray:
        if llm.input_ids[: llm.n_tokens].tolist() != ids[: llm.n_tokens] or len(ids) <= llm.n_tokens:
            llm.reset()
        llm.eval(ids[llm.n_tokens :])
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
    """Greedy continuation and each step's gap between the two largest logits."""
    ids, gaps = list(prompt), []
    for _ in range(tokens):
        last = logits(ids)[-1]
        top2 = np.sort(last)[-2:]
        gaps.append(float(top2[1] - top2[0]))
        ids.append(int(last.argmax()))
    return ids[len(prompt) :], gaps


def first_divergence(ours: list[int], theirs: list[int]) -> int | None:
    """The first position where two token sequences differ, None when they are equal."""
    return next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=True)) if a != b), None)


def perplexity(logits: Logits, ids: list[int]) -> float:
    scores = torch.from_numpy(logits(ids)[:-1]).double()
    return math.exp(torch.nn.functional.cross_entropy(scores, torch.tensor(ids[1:])).item())
