"""Where a CUDA decode step's time goes, inside the engine (no HTTP): for each case, streams run through
`Engine.stream` until every one has decoded a few tokens; then tokens/s over a window, then torch.profiler's GPU
timeline over a shorter one, then tokens/s again. From the timeline: how busy the GPU was, the steps in it (the LM
head's GEMM, the one kernel of its size per step), and each kernel's time per step.

Cases: `plain64` (64 unconstrained greedy streams after a short chat prompt), `beside64` (the same with one of them
constrained by a long JSON schema: what a constrained row costs the step, without the HTTP layer), `schema64` (all
64 constrained by it: the host's grammar work per step against the device's forward), `long64` (64
streams after distinct 2,000-token prompts, their prefixes cached by an untimed first run), `batch1` (one stream).

    PYTHONPATH=src python bench/step_profile.py --model /tmp/m8b --dtype bfloat16 --out DIR
    PYTHONPATH=src python bench/step_profile.py --summarize DIR   # the tables again from DIR's traces

Writes DIR/<case>.trace.json.gz (Chrome traces: chrome://tracing, Perfetto) and DIR/step_profile.json; prints a
table per case.
"""

import argparse
import collections
import gzip
import json
import statistics
import sys
import threading
import time
from pathlib import Path

CASES = ("plain64", "beside64", "schema64", "long64", "batch1")
KERNEL_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="a model directory or GGUF file (an 8B shape: bench/shapes.py)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES))
    parser.add_argument("--window", type=float, default=1.0, help="seconds of each unprofiled rate window")
    parser.add_argument("--profiled", type=float, default=0.3, help="seconds of the profiled window")
    parser.add_argument("--summarize", type=Path, help="print the tables of the traces in this folder; run nothing")
    parser.add_argument("--out", type=Path, default=Path(f"rbee-step-profile-{time.strftime('%Y%m%d-%H%M%S')}"))
    return parser.parse_args(argv)


def summarize(trace: Path, top: int = 14) -> dict:
    """GPU busy fraction, steps and per-step kernel times of one trace."""
    with gzip.open(trace) as file:
        events = json.load(file)["traceEvents"]
    kernels = sorted(
        (e for e in events if e.get("ph") == "X" and e.get("cat") in KERNEL_CATEGORIES), key=lambda e: e["ts"]
    )
    start, end = kernels[0]["ts"], max(e["ts"] + e["dur"] for e in kernels)
    busy, span_start, span_end = 0.0, kernels[0]["ts"], kernels[0]["ts"]
    for e in kernels:
        if e["ts"] > span_end:
            busy += span_end - span_start
            span_start = e["ts"]
        span_end = max(span_end, e["ts"] + e["dur"])
    busy += span_end - span_start
    times: dict[str, list[float]] = collections.defaultdict(list)
    for e in kernels:
        times[e["name"]].append(e["dur"])
    # One launch per step: the LM head's GEMM, the kernel of the longest median launch.
    steps = len(max(times.values(), key=statistics.median))
    per_step = sorted(((sum(d) / steps, len(d) / steps, name) for name, d in times.items()), reverse=True)
    return {
        "window_us": end - start,
        "gpu_busy": busy / (end - start),
        "steps": steps,
        "step_ms": (end - start) / steps / 1e3,
        "kernels_per_step": len(kernels) / steps,
        "top": [
            {"us_per_step": us, "calls_per_step": calls, "kernel": name[:100]} for us, calls, name in per_step[:top]
        ],
    }


def print_summary(case: str, rates: dict, summary: dict) -> None:
    print(f"\n## {case}: {json.dumps({k: round(v, 1) for k, v in rates.items()})}")
    print(f"GPU busy {summary['gpu_busy']:.3f} over {summary['window_us'] / 1e3:.0f} ms, {summary['steps']} steps of "
          f"{summary['step_ms']:.2f} ms, {summary['kernels_per_step']:.0f} kernels a step")  # fmt: skip
    print("| us / step | calls / step | kernel |\n|---|---|---|")
    for row in summary["top"]:
        print(f"| {row['us_per_step']:.1f} | {row['calls_per_step']:.1f} | `{row['kernel']}` |")


def run_case(engine: object, requests: list, args: argparse.Namespace, trace: Path | None) -> dict:
    """The requests at once; tokens/s before, during and after a profiled window (see the module docstring), whose
    trace goes to `trace` (None: a warm-up, run to its end and neither timed nor profiled)."""
    import torch

    from rbee_worker.engine.request_types import Token

    times: list[list[float]] = [[] for _ in requests]

    def consume(i: int) -> None:
        for event in engine.stream(requests[i]):
            if isinstance(event, Token):
                times[i].append(time.perf_counter())

    threads = [threading.Thread(target=consume, args=(i,), daemon=True) for i in range(len(requests))]
    for thread in threads:
        thread.start()
    if trace is None:
        for thread in threads:
            thread.join()
        return {}
    while min(len(t) for t in times) < 30:
        time.sleep(0.005)
    print(f"{trace.name}: every stream decodes", flush=True)

    def window(seconds: float) -> float:
        started = time.perf_counter()
        time.sleep(seconds)
        ended = time.perf_counter()
        return sum(1 for ts in times for t in ts if started < t <= ended) / (ended - started)

    rates = {"tok_s": window(args.window)}
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as profile:
        rates["tok_s_profiled"] = window(args.profiled)
    rates["tok_s_after"] = window(args.window)
    raw = trace.with_suffix("")
    profile.export_chrome_trace(str(raw))
    with raw.open("rb") as source, gzip.open(trace, "wb") as target:
        target.write(source.read())
    raw.unlink()
    for thread in threads:
        thread.join()
    return rates


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.summarize:
        for case in CASES:
            if (trace := args.summarize / f"{case}.trace.json.gz").exists():
                print_summary(case, {}, summarize(trace))
        return 0
    if not args.model:
        raise SystemExit("error: --model is required (or --summarize DIR)")
    sys.path.insert(0, str(Path(__file__).parent))
    import structured_output

    from rbee_worker.benchmark.run import TEXT, tokenizer_of
    from rbee_worker.engine.engine import Engine
    from rbee_worker.engine.engine_config import EngineConfig
    from rbee_worker.engine.request_types import Request
    from rbee_worker.engine.sampling.sampling_params import SamplingParams
    from rbee_worker.engine.structured.grammar import GrammarSpec
    from rbee_worker.hardware.devices import resolve_placement
    from rbee_worker.loading.loader import load_model

    placement = resolve_placement("cuda", args.dtype)
    engine = Engine(lambda: load_model(args.model, placement), EngineConfig(max_batch=64, compile_model=True))
    engine.loaded  # noqa: B018 (waits for the load, the compilation and the graphs)
    greedy = SamplingParams(temperature=0)
    chat = engine.model.tokenize_chat([{"role": "user", "content": structured_output.ASK}])
    ids = tokenizer_of(Path(args.model))(TEXT * 60, add_special_tokens=False)["input_ids"]
    # Long enough to outlast the windows: 30 tokens, then the three windows at the slowest case's rate.
    length = int(30 + (2 * args.window + args.profiled) * 250)

    def plain(prompt: tuple[int, ...] = chat) -> Request:
        return Request(prompt, max_tokens=length, sampling=greedy, ignore_eos=True)

    def requests_for(case: str) -> list[Request]:
        if case in ("beside64", "schema64"):
            grammar = engine.model.grammars.compile(GrammarSpec.json_schema(structured_output.schema(40))).result()

            def constrained() -> Request:
                return Request(chat, max_tokens=4 * length, sampling=greedy, grammar=grammar)

            if case == "schema64":
                return [constrained() for _ in range(64)]
            return [constrained(), *(plain() for _ in range(63))]
        if case == "long64":
            return [plain((1000 + i, *ids[:1999])) for i in range(64)]
        return [plain() for _ in range(1 if case == "batch1" else 64)]  # each its own request id

    args.out.mkdir(parents=True, exist_ok=True)
    results = {}
    run_case(engine, requests_for("plain64"), args, None)  # the first steps' costs
    for case in args.cases:
        if case == "long64":  # caches the prompts' prefixes: the timed run's streams all decode together
            run_case(engine, requests_for("long64"), args, None)
        trace = args.out / f"{case}.trace.json.gz"
        rates = run_case(engine, requests_for(case), args, trace)
        results[case] = {"rates": rates, **summarize(trace)}
        print_summary(case, rates, results[case])
    engine.close()
    (args.out / "step_profile.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
