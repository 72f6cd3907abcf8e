"""One decode step replayed as a CUDA graph (the engine's DecodeGraphs) for a few (rows, attention span) buckets: the
model plain with transformers' sdpa attention, plain with the engine's attention (engine/runners/torch/attention.py),
and through torch.compile (inductor kernels inside the same graph). GPU only.

    PYTHONPATH=src python bench/graph_compile.py --model M [--dynamic] [--regional]

Without --dynamic each shape is compiled for itself (a fair kernel-level comparison); with it, the engine's own
setting (`torch.compile(dynamic=True)`, one compilation for all shapes). --regional compiles the decoder layers
instead of the whole model, as the engine's --compile does (engine/runners/torch/compiled.py: the layers share one
compiled code, dynamic shapes, so the compile time is about one layer's). Prints each step time (median of 3 x 50
replays) and writes bench/results/graph_compile_<model>_<card>.json.
"""

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from rbee_worker.engine.runners.torch.attention import use_engine_attention
from rbee_worker.engine.runners.torch.compiled import compile_model
from rbee_worker.engine.runners.torch.cuda_graphs import DecodeGraphs
from rbee_worker.engine.runners.torch.kv_cache import SlotCache
from rbee_worker.engine.runners.torch.torch_runner import cache_kwarg
from rbee_worker.engine.sampling.sampler_state import SamplerFeatures, SamplerState
from rbee_worker.hardware.devices import resolve_placement
from rbee_worker.loading.loader import load_model

SHAPES = ((1, 1024), (64, 1024))


def step_seconds(graphs: DecodeGraphs, rows: int, span: int) -> float:
    graph, _, _ = graphs._graph(rows, span, SamplerFeatures())
    for _ in range(5):
        graph.replay()
    torch.cuda.synchronize()
    runs = []
    for _ in range(3):
        started = time.perf_counter()
        for _ in range(50):
            graph.replay()
        torch.cuda.synchronize()
        runs.append((time.perf_counter() - started) / 50)
    return statistics.median(runs)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--dynamic", action="store_true")
    parser.add_argument("--regional", action="store_true")
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args()
    model = load_model(args.model, resolve_placement("cuda", "bfloat16")).model
    cache = SlotCache(model.config, max(r for r, _ in SHAPES), 2048, torch.bfloat16, model.device)
    state = SamplerState(cache.slots, model.get_output_embeddings().out_features, model.device)
    card = torch.cuda.get_device_name(model.device)
    result: dict = {
        "model": args.model, "card": card, "torch": torch.__version__, "dynamic": args.dynamic,
        "regional": args.regional, "rows": [],
    }  # fmt: skip
    with torch.inference_mode():
        sdpa = DecodeGraphs(model, cache, cache_kwarg(model), torch.bfloat16, state)  # transformers' own sdpa attention
        sdpa_s = {shape: step_seconds(sdpa, *shape) for shape in SHAPES}  # captured before the switch below
        use_engine_attention(model)
        plain = DecodeGraphs(model, cache, cache_kwarg(model), torch.bfloat16, state)
        plain_s = {shape: step_seconds(plain, *shape) for shape in SHAPES}  # captured before any compilation
        if args.regional:
            compile_model(model, cache)
            forward = model
        else:
            forward = torch.compile(model, dynamic=args.dynamic)
        compiled = DecodeGraphs(forward, cache, cache_kwarg(model), torch.bfloat16, state)
        for rows, span in SHAPES:
            eager_s = plain_s[rows, span]
            started = time.perf_counter()
            compiled._graph(rows, span, SamplerFeatures())
            compile_s = time.perf_counter() - started
            compiled_s = step_seconds(compiled, rows, span)
            row = {"rows": rows, "span": span, "sdpa_ms": sdpa_s[rows, span] * 1e3, "plain_ms": eager_s * 1e3,
                   "compiled_ms": compiled_s * 1e3, "compile_and_capture_s": compile_s}  # fmt: skip
            result["rows"].append(row)
            print(json.dumps(row), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    variant = ("_dynamic" if args.dynamic else "") + ("_regional" if args.regional else "")
    name = f"graph_compile_{Path(args.model).stem}_{card.replace(' ', '_')}{variant}"
    (args.out / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
