"""The paged split-KV decode attention kernel (src/rbee_worker/kernels/decode_attention.py) alone on CUDA: the bytes of
keys and values it reads per second for decode shapes of a model, over its launch parameters, against the GPU's read
bandwidth measured in the same run.

Each case is (rows, context): every row attends to `context` positions whose blocks are scattered over the pool (a
random permutation, as a served pool's are). One timed call runs the kernel over --layers layers, each its own pool,
so that the keys and values come from memory rather than the L2 cache, as in a model's forward. Times come from
triton.testing.do_bench_cudagraph (the launches replayed in a CUDA graph, as the engine's decode graphs do). First the
programs per multiprocessor (which sets `splits`) are swept at the default block, warps and stages; then block,
warps and stages at the best of those. Every configuration's output is checked against the plain-torch reference.

    PYTHONPATH=src python bench/decode_attention.py --shape llama-3.1-8b
"""

import argparse
import itertools
import json
import time
from pathlib import Path

import torch
import triton
from triton.testing import do_bench_cudagraph

from rbee_worker.engine.runners.torch.attention import paged_reference
from rbee_worker.kernels import decode_attention as kernel

SHAPES = {"llama-3.1-8b": (32, 8, 128), "llama-3.2-1b": (32, 8, 64), "llama-3.1-70b": (64, 8, 128)}
CASES = ((1, 32), (1, 8000), (64, 100), (64, 2000))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama-3.1-8b")
    parser.add_argument("--layers", type=int, default=8, help="pools per timed call (keeps them out of L2)")
    parser.add_argument("--block-size", type=int, default=16, help="positions per KV block")
    parser.add_argument("--out", type=Path, default=Path("bench/results/decode_attention"))
    return parser.parse_args(argv)


def read_bandwidth() -> float:
    """Bytes per second of a sum over 4 GiB (reads only)."""
    data = torch.ones(2**31, dtype=torch.bfloat16, device="cuda")
    seconds = do_bench_cudagraph(lambda: data.sum(), rep=50) / 1e3
    return data.numel() * data.element_size() / seconds


class Case:
    """Queries, per-layer pools and block tables for `rows` rows of `context` positions each."""

    def __init__(self, rows: int, context: int, shape: tuple[int, int, int], layers: int, block_size: int) -> None:
        heads, kv_heads, dim = shape
        self.rows, self.context, self.kv_heads = rows, context, kv_heads
        per_row = -(-context // block_size)
        blocks = rows * per_row + 1  # block 0 is the scratch block, as in the engine's pool
        self.query = torch.randn(rows, heads, 1, dim, device="cuda", dtype=torch.bfloat16)
        self.pools = [
            (
                torch.randn(blocks, block_size, kv_heads, dim, device="cuda", dtype=torch.bfloat16),
                torch.randn(blocks, block_size, kv_heads, dim, device="cuda", dtype=torch.bfloat16),
            )
            for _ in range(layers)
        ]
        order = torch.randperm(blocks - 1, device="cuda")[: rows * per_row] + 1
        self.tables = order.reshape(rows, per_row).to(torch.int32)
        self.lengths = torch.full((rows,), context, device="cuda", dtype=torch.int32)
        self.scale = dim**-0.5
        self.bytes = layers * rows * context * kv_heads * dim * 2 * 2  # keys and values, bfloat16

    def run(self, splits: int, block: int, warps: int, stages: int) -> list[torch.Tensor]:
        return [
            kernel.paged_decode_attention(
                self.query, k, v, self.tables, self.lengths, self.scale, splits, block=block, warps=warps, stages=stages
            )
            for k, v in self.pools
        ]

    def check(self, output: torch.Tensor) -> float:
        k, v = self.pools[-1]
        expected = paged_reference(self.query, k, v, self.tables, self.lengths, self.scale)
        return (output.float() - expected.float()).abs().max().item()


def measure(case: Case, splits: int, block: int, warps: int, stages: int) -> dict:
    error = case.check(case.run(splits, block, warps, stages)[-1])
    ms = do_bench_cudagraph(lambda: case.run(splits, block, warps, stages), rep=30)
    return {
        "splits": splits, "block": block, "warps": warps, "stages": stages,
        "us_per_layer": 1e3 * ms / len(case.pools), "gb_s": case.bytes / (ms / 1e3) / 1e9, "max_error": error,
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device("cuda")
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    bandwidth = read_bandwidth()
    gpu = torch.cuda.get_device_name(device)
    print(f"{gpu}: {sms} multiprocessors, read bandwidth {bandwidth / 1e9:.0f} GB/s")
    results = []
    for rows, context in CASES:
        case = Case(rows, context, SHAPES[args.shape], args.layers, args.block_size)
        default_splits = kernel.splits_for(rows, case.kv_heads, device)
        defaults = (kernel.BLOCK_S, kernel.WARPS, kernel.STAGES)
        sweep = []
        for per_sm in (1, 2, 4, 8, 16):
            splits = min(kernel.MAX_SPLITS, max(1, triton.cdiv(per_sm * sms, rows * case.kv_heads)))
            if all(r["splits"] != splits for r in sweep):
                sweep.append(measure(case, splits, *defaults) | {"per_sm": per_sm})
        best_splits = max(sweep, key=lambda r: r["gb_s"])["splits"]
        for block, warps, stages in itertools.product((32, 64, 128), (4, 8), (2, 3, 4)):
            if (block, warps, stages) != defaults:
                sweep.append(measure(case, best_splits, block, warps, stages))
        default = next(
            r for r in sweep if r["splits"] == default_splits and (r["block"], r["warps"], r["stages"]) == defaults
        )
        best = max(sweep, key=lambda r: r["gb_s"])
        results.append({"rows": rows, "context": context, "default": default, "best": best, "sweep": sweep})
        print(
            f"rows {rows:3d} context {context:5d}: default (splits {default['splits']}) {default['gb_s']:6.0f} GB/s"
            f" = {default['gb_s'] * 1e9 / bandwidth:.2f} of read bandwidth, {default['us_per_layer']:.1f} us/layer;"
            f" best {best['gb_s']:6.0f} GB/s = {best['gb_s'] * 1e9 / bandwidth:.2f} (splits {best['splits']},"
            f" block {best['block']}, warps {best['warps']}, stages {best['stages']}),"
            f" max error {best['max_error']:.1e}"
        )
        del case
        torch.cuda.empty_cache()
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{args.shape}_{gpu.replace(' ', '_')}.json"
    meta = {"gpu": gpu, "multiprocessors": sms, "read_bandwidth_gb_s": bandwidth / 1e9, "torch": torch.__version__}
    path.write_text(json.dumps({"machine": meta, "time": time.time(), "cases": results}, indent=1))
    print(f"saved {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
