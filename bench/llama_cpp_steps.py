"""Where a step's time goes on the llama.cpp runtime, in the engine itself (no HTTP), against llama.cpp's bare batched
`llama_decode` loop (benchmark/llama_cpp.py's `batched_decode`, the `llama.cpp` peer of `rbee-worker bench`) on the
same file in the same process.

For each stream count and sampling, the engine decodes that many streams of --tokens tokens (short distinct prompts,
`ignore_eos`), twice (the first a warm-up), and the engine thread's time per step is split by timers around its calls:
`llama_decode`, the sampler (RowSampling.sample), the rest of the runner's step (the batch, bookkeeping, results),
the output (OutputProcessor.process: detokenizing, stop strings, events), scheduling (Scheduler.schedule and
Scheduler.update), taking requests from the inbox, and what is left of the loop. Then the bare loop decodes the same
count of sequences (greedy, or with llama.cpp's own sampler chains for chat). Served figures (through HTTP, the client
beside the worker) come from `rbee-worker bench --peers llama.cpp`.

    PYTHONPATH=src python bench/llama_cpp_steps.py --streams 1 4 16 --sampling greedy chat --out bench/results/x
"""

import argparse
import collections
import contextlib
import functools
import json
import queue
import statistics
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import llama_cpp.llama_cpp as native

from rbee_worker.benchmark.llama_cpp import batched_decode
from rbee_worker.benchmark.peers import SAMPLING
from rbee_worker.benchmark.run import TEXT, machine
from rbee_worker.engine.engine import Engine
from rbee_worker.engine.engine_config import EngineConfig
from rbee_worker.engine.output_processor import OutputProcessor
from rbee_worker.engine.request_types import End, Error, Request
from rbee_worker.engine.runners.llama_cpp.llama_cpp_runner import LlamaCppRunner
from rbee_worker.engine.runners.rows import RowSampling
from rbee_worker.engine.sampling.sampling_params import SamplingParams
from rbee_worker.engine.scheduling.scheduler import Scheduler
from rbee_worker.hardware.devices import resolve_placement
from rbee_worker.loading.demo import demo_model_path
from rbee_worker.loading.loader import load_model

PHASES = ("llama_decode", "sample", "runner_rest", "output", "schedule", "admit", "loop_rest")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="demo", help="a GGUF file (default: the demo)")
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--sampling", nargs="+", choices=sorted(SAMPLING), default=["greedy", "chat"])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of each case (medians)")
    parser.add_argument("--out", type=Path, default=Path("bench/results/llama_cpp_steps"))
    return parser.parse_args()


class Timers:
    """Seconds spent in each wrapped callable, and how many calls, while `on`."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = collections.defaultdict(float)
        self.calls: dict[str, int] = collections.defaultdict(int)
        self.on = False

    def wrap(self, owner: object, name: str, key: str) -> None:
        original = getattr(owner, name)

        @functools.wraps(original)
        def timed(*args, **kwargs):
            if not self.on:
                return original(*args, **kwargs)
            started = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds[key] += time.perf_counter() - started
                self.calls[key] += 1

        setattr(owner, name, timed)

    @contextlib.contextmanager
    def window(self) -> Iterator[None]:
        self.seconds.clear()
        self.calls.clear()
        self.on = True
        try:
            yield
        finally:
            self.on = False


def install(timers: Timers) -> None:
    timers.wrap(native, "llama_decode", "llama_decode")
    timers.wrap(RowSampling, "sample", "sample")
    timers.wrap(LlamaCppRunner, "step", "runner")
    timers.wrap(OutputProcessor, "process", "output")
    timers.wrap(Scheduler, "schedule", "schedule")
    timers.wrap(Scheduler, "update", "schedule")
    timers.wrap(Engine, "_admit", "admit")


def run_streams(engine: Engine, prompts: list[tuple[int, ...]], tokens: int, sampling: SamplingParams) -> None:
    ends: queue.SimpleQueue = queue.SimpleQueue()

    def sink(event: object) -> None:
        if isinstance(event, End | Error):
            ends.put(event)

    for i, prompt in enumerate(prompts):
        engine.submit(Request(prompt, max_tokens=tokens, sampling=sampling, seed=i, ignore_eos=True), sink)
    for _ in prompts:
        event = ends.get(timeout=600)
        assert isinstance(event, End), event


def breakdown(timers: Timers, steps: int) -> dict[str, float]:
    """Milliseconds per step of each phase."""
    s = timers.seconds
    per = {
        "llama_decode": s["llama_decode"],
        "sample": s["sample"],
        "runner_rest": s["runner"] - s["llama_decode"] - s["sample"],
        "output": s["output"],
        "schedule": s["schedule"],
        "admit": s["admit"],
    }
    return {k: 1000 * v / steps for k, v in per.items()}


def measure(engine: Engine, timers: Timers, streams: int, mode: str, args: argparse.Namespace) -> dict:
    sampling = SamplingParams(**SAMPLING[mode])
    runs = []
    for repeat in range(args.repeats + 1):
        prompts = [engine.model.tokenize(f"{repeat}-{i}: {TEXT[:120]}") for i in range(streams)]
        with timers.window():
            started = time.perf_counter()
            run_streams(engine, prompts, args.tokens, sampling)
            wall = time.perf_counter() - started
        steps = timers.calls["llama_decode"]
        phases = breakdown(timers, steps)
        phases["loop_rest"] = 1000 * wall / steps - sum(phases.values())
        runs.append({"tok_s": streams * args.tokens / wall, "step_ms": 1000 * wall / steps, **phases})
    timed = runs[1:]  # the first is a warm-up
    return {key: statistics.median(run[key] for run in timed) for key in timed[0]}


def bare(path: str, streams: int, mode: str, args: argparse.Namespace, prompts: list[list[int]]) -> float:
    sampling = SAMPLING[mode] if SAMPLING[mode].get("temperature", 0) > 0 else None
    rates = [batched_decode(path, args.threads, prompts, args.tokens, sampling).aggregate_tok_s for _ in range(2)]
    return max(rates)


def table(results: dict, print_: Callable[[str], None] = print) -> None:
    print_("| streams | sampling | engine tok/s | bare loop tok/s | ratio | step ms | " + " | ".join(PHASES) + " |")
    print_("|---" * (6 + len(PHASES)) + "|")
    for key, row in results["cases"].items():
        streams, mode = key.split("@")
        phases = " | ".join(f"{row[p]:.2f}" for p in PHASES)
        print_(
            f"| {streams} | {mode} | {row['tok_s']:.1f} | {row['bare_tok_s']:.1f} | {row['ratio']:.3f} | "
            f"{row['step_ms']:.2f} | {phases} |"
        )


def main() -> None:
    args = parse_args()
    path = str(demo_model_path()) if args.model == "demo" else args.model
    timers = Timers()
    install(timers)
    results: dict = {"machine": machine(), "args": {k: str(v) for k, v in vars(args).items()}, "cases": {}}
    for streams in args.streams:
        engine = Engine(
            lambda: load_model(path, resolve_placement("cpu", "auto"), runtime="llama.cpp"),
            EngineConfig(max_batch=max(streams, 1), threads=args.threads),
        )
        try:
            engine.loaded  # noqa: B018 -- waits for the load
            system = native.llama_print_system_info().decode().strip()
            results["llama_cpp_system"] = system
            for mode in args.sampling:
                row = measure(engine, timers, streams, mode, args)
                prompts = [list(engine.model.tokenize(f"bare-{i}: {TEXT[:120]}")) for i in range(streams)]
                results["cases"][f"{streams}@{mode}"] = row
                row["bare_tok_s"] = bare(path, streams, mode, args, prompts)
                row["ratio"] = row["tok_s"] / row["bare_tok_s"]
                print(json.dumps({f"{streams}@{mode}": row}), flush=True)
        finally:
            engine.close()
    table(results)
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out / f"llama_cpp_steps_{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(json.dumps(results, indent=1))
    print(f"saved {out}")


if __name__ == "__main__":
    main()
