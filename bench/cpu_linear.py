"""One decode-step matrix product on the CPU (one row, bf16 or --dtype), through aten (what transformers' nn.Linear
runs) and through oneDNN with the weight reordered once into its blocked layout (what inductor's freezing and IPEX do).

    .venv/bin/python bench/cpu_linear.py [--threads 2] [--dtype float32 --small]

The shapes are the demo model's (SmolLM2-135M: hidden 576, MLP 1536, vocabulary 49152); with --small, square ones
from 64 to 1024 wide and a router's 8 x 64 too (where packing stops paying: cpu_linear.MIN_PACKED_WEIGHTS). Prints a
table (median of 5 timings of 200 calls each) and writes bench/results/cpu_linear[_<dtype>_small].json. A profile of a
bf16 decode step of the demo model showed aten::mm taking 78% of it (211 products per step), so this is where the
CPU's step time is.
"""

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

SHAPES = {"q/o projection": (576, 576), "k/v projection": (192, 576), "MLP up/gate": (1536, 576),
          "MLP down": (576, 1536), "LM head": (49152, 576)}  # fmt: skip
SMALL = {"router": (8, 64), **{f"square {n}": (n, n) for n in (64, 128, 256, 384, 512, 768, 1024)}}


def timed(call, calls: int = 200) -> float:
    for _ in range(10):
        call()
    runs = []
    for _ in range(5):
        started = time.perf_counter()
        for _ in range(calls):
            call()
        runs.append((time.perf_counter() - started) / calls)
    return statistics.median(runs)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--small", action="store_true", help="the small shapes (SMALL) too")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    # Weights hot in cache here (each product repeats 200 times); in a real step they stream from memory, so these
    # are lower bounds for both paths.
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    rows = {}
    print(f"{'product':<16} {'out x in':>12} {'aten us':>9} {'oneDNN packed us':>17} {'speed-up':>9}")
    for name, (out_features, in_features) in {**SHAPES, **(SMALL if args.small else {})}.items():
        weight = torch.randn(out_features, in_features, dtype=dtype)
        x = torch.randn(1, in_features, dtype=dtype)
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, 1)
        expected = torch.nn.functional.linear(x, weight)
        got = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
        assert torch.allclose(got.float(), expected.float(), rtol=2e-2, atol=2e-2)  # the same product
        aten = timed(lambda w=weight, x=x: torch.nn.functional.linear(x, w))
        onednn = timed(lambda p=packed, x=x: torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], ""))
        rows[name] = {"shape": [out_features, in_features], "aten_us": aten * 1e6, "onednn_packed_us": onednn * 1e6}
        shape = f"{out_features}x{in_features}"
        print(f"{name:<16} {shape:>12} {aten * 1e6:>9.1f} {onednn * 1e6:>17.1f} {aten / onednn:>8.2f}x")
    result = {
        "what": f"one-row {args.dtype} linear, aten (F.linear) vs oneDNN with the weight reordered once",
        "machine": f"{platform.machine()}, {args.threads} threads, torch {torch.__version__}",
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "rows": rows,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    name = "cpu_linear" + (f"_{args.dtype}_small" if args.small else "")
    (args.out / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
