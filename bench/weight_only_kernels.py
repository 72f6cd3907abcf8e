"""The products of one Llama-3.1-8B decode step (32 layers' q/k/v/o/gate/up/down and the LM head, distinct matrices so
that nothing stays in cache) replayed as one CUDA graph, per weight format: bfloat16 (cuBLAS); int4 group 32 as
PyTorch's tinygemm (`_weight_int4pack_mm`), as Int4Linear runs it on CUDA (cuda_weight_only.py: the GEMV kernel at one
row, the tl.dot kernel up to INT4_DOT_ROWS, the weights dequantized for cuBLAS beyond), as the tl.dot kernel and as the
dequantized weights at every row count, and the dequantizing alone; int8 per row as PyTorch's `_weight_int8pack_mm` and
as our Triton kernels that Int8Linear runs on CUDA. GPU only; random weights.

    PYTHONPATH=src python bench/weight_only_kernels.py [--merged]

Prints the median of 20 replays per (format, rows) and writes bench/results/weight_only_kernels_<card>.json.
"""

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from rbee_worker.kernels.cuda_weight_only import _int4_dot, int4_dequantize, int4_dot, int8_matmul
from rbee_worker.layers.int4_linear import Int4Linear

LAYERS = 32
HIDDEN, KV, MLP, VOCAB = 4096, 1024, 14336, 128256
SHAPES = ((HIDDEN, HIDDEN), (KV, HIDDEN), (KV, HIDDEN), (HIDDEN, HIDDEN), (MLP, HIDDEN), (MLP, HIDDEN), (HIDDEN, MLP))
# q/k/v as one matrix and gate/up as one (what vLLM loads): the same bytes in 4 products per layer instead of 7.
MERGED = ((HIDDEN + 2 * KV, HIDDEN), (HIDDEN, HIDDEN), (2 * MLP, HIDDEN), (HIDDEN, MLP))
ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 512)


def graph_ms(products: Callable[[dict[int, torch.Tensor]], None], rows: int) -> float:
    inputs = {k: torch.randn(rows, k, device="cuda", dtype=torch.bfloat16) for k in (HIDDEN, MLP)}
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up (and Triton's autotuning) before capture
        products(inputs)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        products(inputs)
    times = []
    for _ in range(23):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times[3:])[10]


def matrices(make: Callable[[int, int], object], shapes: tuple[tuple[int, int], ...]) -> list[object]:
    return [make(out, inp) for _ in range(LAYERS) for out, inp in shapes] + [make(VOCAB, HIDDEN)]


def read_bandwidth() -> float:
    """Bytes per second of reading a 4 GiB tensor (float32 sum)."""
    data = torch.empty(2**30, device="cuda", dtype=torch.float32)
    data.sum()
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(10):
        data.sum()
    torch.cuda.synchronize()
    return 10 * data.nbytes / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--merged", action="store_true", help="q/k/v and gate/up as one matrix each")
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args()
    shapes = MERGED if args.merged else SHAPES
    card = torch.cuda.get_device_name()
    result: dict = {
        "card": card, "torch": torch.__version__, "merged": args.merged, "read_GBps": read_bandwidth() / 1e9,
        "formats": {},
    }  # fmt: skip

    def bf16(out: int, inp: int) -> torch.Tensor:
        return torch.randn(out, inp, device="cuda", dtype=torch.bfloat16) * 0.02

    def int4(out: int, inp: int) -> Int4Linear:
        codes = torch.randint(0, 16, (out, inp), device="cuda", dtype=torch.int32)
        scales = torch.rand(out, inp // 32, device="cuda") * 0.01
        return Int4Linear(codes, scales, torch.zeros_like(scales), None)

    def tinygemm(out: int, inp: int) -> tuple[torch.Tensor, torch.Tensor]:
        pairs = torch.randint(0, 256, (out, inp // 2), device="cuda", dtype=torch.uint8)
        scales_and_zeros = torch.rand(inp // 32, out, 2, device="cuda", dtype=torch.bfloat16) * 0.01
        return torch.ops.aten._convert_weight_to_int4pack(pairs, 8), scales_and_zeros

    def dequantized(x: torch.Tensor, layer: Int4Linear) -> torch.Tensor:
        return F.linear(x, int4_dequantize(layer.packed, layer.scales_and_zeros, x.dtype))

    def dequantize_only(x: torch.Tensor, layer: Int4Linear) -> torch.Tensor:
        return int4_dequantize(layer.packed, layer.scales_and_zeros, x.dtype)

    def int8(out: int, inp: int) -> tuple[torch.Tensor, torch.Tensor]:
        codes = torch.randint(-127, 128, (out, inp), device="cuda", dtype=torch.int8)
        return codes, torch.rand(out, device="cuda") * 1e-3

    formats: dict[str, tuple[Callable, Callable]] = {
        "bfloat16 (cuBLAS)": (bf16, lambda x, w: F.linear(x, w)),
        "int4 g32 (tinygemm)": (tinygemm, lambda x, w: torch.ops.aten._weight_int4pack_mm(x, w[0], 32, w[1])),
        "int4 g32 (Int4Linear)": (int4, lambda x, layer: layer(x)),
        "int4 g32 (tl.dot kernel)": (int4, lambda x, layer: int4_dot(x, layer.packed, layer.scales_and_zeros)),
        "int4 g32 (dequantized + cuBLAS)": (int4, dequantized),
        "int4 g32 (dequantizing alone)": (int4, dequantize_only),
        "int8 (Triton, ours)": (int8, lambda x, w: int8_matmul(x, *w)),
        "int8 (_weight_int8pack_mm)": (int8, lambda x, w: torch.ops.aten._weight_int8pack_mm(x, w[0], w[1].bfloat16())),
    }
    for name, (make, apply) in formats.items():
        weights = matrices(make, shapes)

        def products(inputs: dict[int, torch.Tensor], weights: list = weights, apply: Callable = apply) -> None:
            for w, (_, inp) in zip(weights, [*shapes * LAYERS, (VOCAB, HIDDEN)], strict=True):
                apply(inputs[inp], w)

        # PyTorch's int8 kernel takes a second at 64 rows; dequantizing does not depend on the rows
        rows = (1,) if "pack_mm" in name or "alone" in name else ROWS
        result["formats"][name] = {str(r): graph_ms(products, r) for r in rows}
        print(name, json.dumps(result["formats"][name]), flush=True)
        del weights
        torch.cuda.empty_cache()
    # the int4 tl.dot kernel's tile per (rows bucket, outputs, inputs), as its autotuning chose
    result["int4_dot_configs"] = {str(key[:3]): str(config) for key, config in _int4_dot.cache.items()}
    args.out.mkdir(parents=True, exist_ok=True)
    name = f"weight_only_kernels_{card.replace(' ', '_')}{'_merged' if args.merged else ''}"
    (args.out / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
