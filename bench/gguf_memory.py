"""Memory of a quantized GGUF model kept quantized: the loaded weight tensors' bytes and the worker process's resident
memory against the file's size, for a Llama-3.1-8B-shape Q4_0 file with random blocks (written with the gguf package,
which cannot write K-quants), loaded with `--quantize int4` on the CPU in bfloat16.

    PYTHONPATH=src python bench/gguf_memory.py [--file /tmp/llama-8b-q4_0.gguf]

The tokenizer is the demo model's, its vocabulary padded with placeholder tokens up to 128256. Writes
bench/results/gguf_memory_<shape>_<type>.json.
"""

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter, TokenType

from rbee_worker.loading.demo import demo_model_path
from rbee_worker.loading.gguf.gguf_format import read_gguf

SHAPE = {"vocab": 128256, "hidden": 4096, "mlp": 14336, "layers": 32, "heads": 32, "kv_heads": 8, "context": 131072}
Q4_0 = GGMLQuantizationType.Q4_0


def q4_0_blocks(rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random Q4_0 data for a (rows, cols) matrix: random codes, each block's float16 scale 0.01."""
    block, size = GGML_QUANT_SIZES[Q4_0]
    data = rng.integers(0, 256, size=(rows, cols // block * size), dtype=np.uint8)
    blocks = data.reshape(rows, cols // block, size)
    blocks[:, :, :2] = np.frombuffer(np.float16(0.01).tobytes(), dtype=np.uint8)
    return data


def write_file(path: Path) -> None:
    demo = read_gguf(demo_model_path()).metadata
    tokens = list(demo["tokenizer.ggml.tokens"])
    padding = SHAPE["vocab"] - len(tokens)
    writer = GGUFWriter(str(path), "llama")
    writer.add_context_length(SHAPE["context"])
    writer.add_embedding_length(SHAPE["hidden"])
    writer.add_feed_forward_length(SHAPE["mlp"])
    writer.add_block_count(SHAPE["layers"])
    writer.add_head_count(SHAPE["heads"])
    writer.add_head_count_kv(SHAPE["kv_heads"])
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(500000.0)
    writer.add_tokenizer_model(demo["tokenizer.ggml.model"])
    writer.add_tokenizer_pre(demo.get("tokenizer.ggml.pre", "default"))
    writer.add_token_list(tokens + [f"<placeholder_{i}>" for i in range(padding)])
    writer.add_token_types(list(demo["tokenizer.ggml.token_type"]) + [TokenType.USER_DEFINED] * padding)
    writer.add_token_merges(list(demo["tokenizer.ggml.merges"]))
    writer.add_bos_token_id(demo["tokenizer.ggml.bos_token_id"])
    writer.add_eos_token_id(demo["tokenizer.ggml.eos_token_id"])
    rng = np.random.default_rng(0)
    hidden, kv = SHAPE["hidden"], SHAPE["hidden"] // SHAPE["heads"] * SHAPE["kv_heads"]
    matrices = {"attn_q": (hidden, hidden), "attn_k": (kv, hidden), "attn_v": (kv, hidden),
                "attn_output": (hidden, hidden), "ffn_gate": (SHAPE["mlp"], hidden), "ffn_up": (SHAPE["mlp"], hidden),
                "ffn_down": (hidden, SHAPE["mlp"])}  # fmt: skip
    norm = np.ones(hidden, dtype=np.float32)
    writer.add_tensor("token_embd.weight", q4_0_blocks(SHAPE["vocab"], hidden, rng), raw_dtype=Q4_0)
    for layer in range(SHAPE["layers"]):
        for name, (rows, cols) in matrices.items():
            writer.add_tensor(f"blk.{layer}.{name}.weight", q4_0_blocks(rows, cols, rng), raw_dtype=Q4_0)
        writer.add_tensor(f"blk.{layer}.attn_norm.weight", norm)
        writer.add_tensor(f"blk.{layer}.ffn_norm.weight", norm)
    writer.add_tensor("output_norm.weight", norm)
    writer.add_tensor("output.weight", q4_0_blocks(SHAPE["vocab"], hidden, rng), raw_dtype=Q4_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


# Run in a fresh process, so that its resident memory is the worker's load alone.
MEASURE = """
import json, sys, psutil, torch
from rbee_worker.hardware.devices import Placement
from rbee_worker.loading.loader import load_model
loaded = load_model(sys.argv[1], Placement(torch.device("cpu"), torch.bfloat16), quantize="int4")
kinds = {}
for module in loaded.model.modules():
    kinds[type(module).__name__] = kinds.get(type(module).__name__, 0) + 1
print(json.dumps({"weight_bytes": loaded.info.weight_bytes, "rss_bytes": psutil.Process().memory_info().rss,
                  "modules": {k: v for k, v in kinds.items() if "Linear" in k or "Embedding" in k}}))
"""


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--file", type=Path, default=Path("/tmp/llama-3.1-8b-shape-q4_0.gguf"))
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args()
    if not args.file.is_file():
        write_file(args.file)
    measured = json.loads(subprocess.run([sys.executable, "-c", MEASURE, str(args.file)], check=True,
                                         capture_output=True, text=True).stdout.splitlines()[-1])  # fmt: skip
    file_bytes = os.path.getsize(args.file)
    result = {
        "shape": "llama-3.1-8b", "type": "Q4_0", "file_bytes": file_bytes, **measured,
        "weight_bytes_over_file": measured["weight_bytes"] / file_bytes,
        "rss_over_file": measured["rss_bytes"] / file_bytes,
    }  # fmt: skip
    print(json.dumps(result, indent=2))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gguf_memory_llama-3.1-8b_Q4_0.json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
