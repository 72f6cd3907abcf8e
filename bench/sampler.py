"""What the device sampler (engine/sampling/sampler.py's `sample`) costs per decode step, against a plain argmax of the
same logits, for a few batch sizes and vocabularies, every row of a step in the same sampling mode.

    PYTHONPATH=src python bench/sampler.py [--device cpu|cuda] [--rows 1,16,64] [--vocab 49152,128256]

On CUDA each (rows, vocab, mode) is captured once as a CUDA graph and replayed, as the engine's decode graphs run the
sampler (the argmax too, and both are also timed eagerly); on the CPU everything runs eagerly. Prints a table of
milliseconds per step (and x argmax) and writes bench/results/sampler/sampler_<device>_<cpu or card>.json.
`--profile` also prints, per (rows, vocab, mode), the device time of each kernel of one eager call (torch.profiler).
"""

import argparse
import json
import re
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from rbee_worker.benchmark.run import machine
from rbee_worker.engine.runners.torch.cuda_graphs import capture
from rbee_worker.engine.sampling.sampler import pack, sample
from rbee_worker.engine.sampling.sampler_state import SamplerFeatures, SamplerState
from rbee_worker.engine.sampling.sampling_params import SamplingParams

CHAT = dict(temperature=0.7, top_p=0.9)
# name: (parameters of every row, top logprobs asked for); chat's settings plus one stage each, as bench/sampling_ratio.
MODES: dict[str, tuple[SamplingParams, int | None]] = {
    "greedy": (SamplingParams(temperature=0.0), None),
    "chat": (SamplingParams(**CHAT), None),
    "chat+top_k50": (SamplingParams(**CHAT, top_k=50), None),
    "chat+repetition1.1": (SamplingParams(**CHAT, repetition_penalty=1.1), None),
    "chat+logprobs5": (SamplingParams(**CHAT), 5),
}
PROMPT_TOKENS = 512  # prompt ids per row, for the repetition penalty


def seconds_per_call(run: Callable[[], object], device: torch.device, calls: int, repeats: int) -> float:
    """Median over `repeats` of the mean time of `calls` back-to-back calls, the device's queue drained around each."""

    def drain() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for _ in range(3):
        run()
    times = []
    for _ in range(repeats):
        drain()
        started = time.perf_counter()
        for _ in range(calls):
            run()
        drain()
        times.append((time.perf_counter() - started) / calls)
    return statistics.median(times)


def graphed(run: Callable[[], object]) -> Callable[[], None]:
    """`run` captured as a CUDA graph (as the engine captures its steps); its replay."""
    graph, _ = capture(run, torch.cuda.graph_pool_handle())
    return graph.replay


def measure(rows: int, vocab: int, args: argparse.Namespace) -> dict:
    device = torch.device(args.device)
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(rows, vocab, generator=gen) * 3).to(device=device, dtype=args.dtype)
    prompt = torch.randint(0, vocab, (PROMPT_TOKENS,), generator=gen).tolist()
    slots = torch.arange(rows, device=device)
    live = torch.ones(rows, dtype=torch.bool, device=device)

    def timed(run: Callable[[], object]) -> dict:
        eager = seconds_per_call(run, device, args.calls, args.repeats) * 1e3
        if device.type != "cuda":
            return {"ms": eager}
        return {"ms": seconds_per_call(graphed(run), device, args.calls, args.repeats) * 1e3, "eager_ms": eager}

    result = {"rows": rows, "vocab": vocab, "argmax": timed(lambda: logits.argmax(-1)), "modes": {}}
    for mode, (params, logprobs) in MODES.items():
        state = SamplerState(rows, vocab, device)
        for slot in range(rows):
            state.assign(slot, params, slot, prompt)
        features = SamplerFeatures.of([(params, logprobs)] * rows)
        figures = timed(lambda state=state, features=features: pack(sample(logits, state, slots, live, features)))
        figures["x_argmax"] = figures["ms"] / result["argmax"]["ms"]
        result["modes"][mode] = figures
        print(rows, vocab, mode, json.dumps(figures), flush=True)
        if args.profile:
            profile(lambda state=state, features=features: pack(sample(logits, state, slots, live, features)))
    return result


def profile(run: Callable[[], object]) -> None:
    """The kernels of one call and their device time, longest first."""
    run()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as profiler:
        run()
        torch.cuda.synchronize()
    print(profiler.key_averages().table(sort_by="device_time_total", row_limit=25, max_name_column_width=60))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rows", default="1,16,64")
    parser.add_argument("--vocab", default="49152,128256")
    parser.add_argument("--dtype", default="bfloat16", help="of the logits (the model's output)")
    parser.add_argument("--calls", type=int, default=20, help="calls per timing")
    parser.add_argument("--repeats", type=int, default=5, help="timings per figure (the median is kept)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads on the CPU")
    parser.add_argument("--profile", action="store_true", help="print each kernel's device time (CUDA)")
    parser.add_argument("--out", type=Path, default=Path("bench/results/sampler"))
    args = parser.parse_args()
    args.dtype = getattr(torch, args.dtype)
    if args.threads:
        torch.set_num_threads(args.threads)
    result: dict = {
        "machine": machine(), "device": args.device, "dtype": str(args.dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(), "calls": args.calls, "repeats": args.repeats, "results": [],
    }  # fmt: skip
    with torch.inference_mode():
        for rows in map(int, args.rows.split(",")):
            for vocab in map(int, args.vocab.split(",")):
                result["results"].append(measure(rows, vocab, args))
    lines = ["| rows | vocab | argmax ms | " + " | ".join(f"{mode} ms | x argmax" for mode in MODES) + " |"]
    lines.append("|" + "---|" * (3 + 2 * len(MODES)))
    for row in result["results"]:
        cells = [str(row["rows"]), str(row["vocab"]), f"{row['argmax']['ms']:.3f}"]
        for figures in row["modes"].values():
            cells += [f"{figures['ms']:.3f}", f"{figures['x_argmax']:.1f}"]
        lines.append("| " + " | ".join(cells) + " |")
    print("\n".join(lines))
    where = result["machine"].get("gpu") if args.device.startswith("cuda") else result["machine"]["cpu"]
    name = "_".join(re.sub(r"\(R\)|\(TM\)|[^\w.-]", " ", where).split())
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"sampler_{args.device.replace(':', '')}_{name}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
