"""Where a decode step's time goes, below the HTTP API: the model's forward alone, the engine driven directly
(no HTTP), for one stream and for N concurrent ones; and time to first token inside the engine against one bare
forward over the same prompt. Meant for GPUs: on a CPU the forwards timed here run on a second thread, at
about half speed (see engine.py). Set beside `rbee-worker bench` (the same figures through HTTP), the differences say
how much the HTTP layer, the engine's host work and the forward each cost.

    python bench/step_time.py --model M --device cuda|cpu --dtype bfloat16 [--threads 2] [--concurrency 1,16,64]
        [--compile | --no-compile] [--quantize int4] [--profile DIR]

On a GPU also: a decode graph's step alone at each batch bucket up to the largest concurrency, and where the engine
thread's time went during the last run at each concurrency (prefill forwards, decode launches, waits for a decode
step's result, the rest: admitting, detokenizing, events), to set beside that run's wall time.

Prints a table and writes bench/results/step_time_<model>_<device>_<card or cpu>[_<quantize>].json (medians of
--repeats).
"""

import argparse
import collections
import functools
import json
import logging
import statistics
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import ClassVar

import torch

from rbee_worker.benchmark.run import cpu_name
from rbee_worker.devices import resolve_placement
from rbee_worker.engine.config import EngineConfig
from rbee_worker.engine.engine import Engine
from rbee_worker.engine.kv_cache import decode_mask
from rbee_worker.engine.runner import PromptRow
from rbee_worker.engine.sampler import SamplerFeatures
from rbee_worker.engine.sampling import SamplingParams
from rbee_worker.engine.types import End, Request, Token
from rbee_worker.models.loader import load_model


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_streams(engine: Engine, prompts: list[tuple[int, ...]], tokens: int) -> tuple[float, float]:
    """The prompts at once (greedy, ignore_eos): (aggregate tokens/s, single-stream decode tokens/s of the first)."""
    times: list[list[float]] = [[] for _ in prompts]
    done = threading.Barrier(len(prompts) + 1)

    def consume(i: int) -> None:
        request = Request(prompts[i], max_tokens=tokens, sampling=SamplingParams(temperature=0), ignore_eos=True)
        for event in engine.stream(request):
            if isinstance(event, Token):
                times[i].append(time.perf_counter())
            elif isinstance(event, End):
                assert event.tokens_out == tokens, event
        done.wait()

    started = time.perf_counter()
    for i in range(len(prompts)):
        threading.Thread(target=consume, args=(i,), daemon=True).start()
    done.wait()
    ended = max(t[-1] for t in times)
    first = times[0]
    return sum(len(t) for t in times) / (ended - started), (len(first) - 1) / (first[-1] - first[0])


class Phases:
    """Seconds and calls of the engine thread's prefill forwards, eager decode steps, graph decode launches and waits
    for their results, wrapped around the engine's own methods; `rows` counts decode steps by their sequences."""

    NAMES: ClassVar[dict[str, tuple[str, str]]] = {  # phase: (the engine's steps or runner, method)
        "prefill": ("steps", "prefill"),
        "decode": ("steps", "_decode_eager"),
        "launch": ("runner", "launch"),
        "collect": ("steps", "_collect"),
    }

    def __init__(self, engine: Engine) -> None:
        self.seconds: collections.Counter[str] = collections.Counter()
        self.calls: collections.Counter[str] = collections.Counter()
        self.rows: collections.Counter[int] = collections.Counter()
        owners = {"steps": engine._steps, "runner": engine._runner}
        for phase, (owner, method) in self.NAMES.items():
            setattr(owners[owner], method, self._timed(phase, getattr(owners[owner], method)))

    def _timed(self, phase: str, method: Callable[[list], object]) -> Callable[[list], object]:
        @functools.wraps(method)
        def timed(arg: list) -> object:
            started = time.perf_counter()
            try:
                return method(arg)
            finally:
                self.seconds[phase] += time.perf_counter() - started
                self.calls[phase] += 1
                if phase in ("decode", "launch"):
                    self.rows[len(arg)] += 1

        return timed

    def reset(self) -> None:
        self.seconds.clear()
        self.calls.clear()
        self.rows.clear()
        self.allocator = allocator_counts()

    def summary(self, wall: float) -> dict:
        return {
            "wall_s": wall,
            **{f"{phase}_s": self.seconds[phase] for phase in self.NAMES},
            **{f"{phase}_calls": self.calls[phase] for phase in self.NAMES},
            "other_s": wall - sum(self.seconds.values()),
            "decode_steps_by_rows": dict(sorted(self.rows.items())),
            # the CUDA caching allocator's calls to the driver during the run: each may synchronize the device
            **{name: count - self.allocator[name] for name, count in allocator_counts().items()},
        }


def allocator_counts() -> dict[str, int]:
    if not torch.cuda.is_available():
        return {}
    stats = torch.cuda.memory_stats()
    return {name: stats.get(name, 0) for name in ("num_alloc_retries", "num_device_alloc", "num_device_free")}


def graph_step_ms(engine: Engine, rows: int, span: int, repeats: int, features: SamplerFeatures) -> float:
    """One decode graph (its sampler stages: `features`) over `rows` rows attending to `span` positions, launched and
    waited for back to back."""
    tokens, positions, lengths = [5] * rows, [span - 1] * rows, [span] * rows
    runs = []
    with torch.inference_mode():  # the graphs' static inputs are inference tensors
        for _ in range(repeats + 1):
            started = time.perf_counter()
            for _ in range(20):
                engine._runner.graphs.launch(tokens, positions, lengths, [False] * rows, features).result()
            runs.append((time.perf_counter() - started) / 20 * 1e3)
    return statistics.median(runs[1:])


def first_token(engine: Engine, prompt: tuple[int, ...]) -> Token:
    """A request for one greedy token through the engine's loop, as a client sees it."""
    request = Request(prompt, max_tokens=1, sampling=SamplingParams(temperature=0))
    return next(e for e in engine.stream(request) if isinstance(e, Token))


def eager_decode(engine: Engine, rows: int, length: int) -> torch.Tensor:
    """One decode step of the engine's forward without its graphs: `rows` rows reading `length` cached positions."""
    device = engine.loaded.info.device
    positions = torch.full((rows, 1), length, device=device)
    engine._runner.cache.prepare(0, positions, length + 1)
    lengths = torch.full((rows,), length + 1, device=device)
    mask = decode_mask(lengths, length + 1, engine.loaded.info.dtype)
    return engine._runner._forward(torch.zeros(rows, 1, dtype=torch.long, device=device), positions, mask)


def profile(out: Path, calls: dict[str, Callable[[], object]], device: torch.device) -> None:
    """Kernel tables (torch.profiler, 3 calls after a warm-up) written to out/<name>.txt, and the timelines (all
    threads, for chrome://tracing or Perfetto) to out/<name>.trace.json."""
    out.mkdir(parents=True, exist_ok=True)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    sort = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
    for name, call in calls.items():
        with torch.inference_mode():
            call()
            sync(device)
            with torch.profiler.profile(activities=activities) as prof:
                for _ in range(3):
                    call()
                sync(device)
        (out / f"{name}.txt").write_text(prof.key_averages().table(sort_by=sort, row_limit=25))
        prof.export_chrome_trace(str(out / f"{name}.trace.json"))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--concurrency", default="1,16,64")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--compile", action=argparse.BooleanOptionalAction, help="the engine's --compile (default: the worker's)"
    )
    parser.add_argument("--quantize", default="none", choices=("none", "int8", "int4"))
    parser.add_argument("--profile", type=Path, help="also write torch.profiler kernel tables to this folder")
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")  # the engine's start-up steps
    if args.threads:
        torch.set_num_threads(args.threads)
    concurrency = [int(c) for c in args.concurrency.split(",")]
    placement = resolve_placement(args.device, args.dtype)
    compiled = args.compile if args.compile is not None else placement.device.type == "cuda"  # the worker's default
    engine = Engine(
        lambda: load_model(args.model, placement, quantize=args.quantize),
        EngineConfig(max_batch=max(concurrency), compile_model=compiled),
    )
    loaded = engine.loaded  # after the cache and the graphs
    device, model = loaded.info.device, loaded.model
    vocab = len(loaded.tokenizer)
    long_prompt = tuple(range(1000, 1000 + args.prompt_tokens))
    short = tuple(range(2000, 2016))
    result: dict = {"model": args.model, "device": args.device, "dtype": args.dtype, "torch": torch.__version__}
    result["quantize"] = args.quantize
    result["compiled"] = engine._runner._compile
    result["card"] = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name()

    # The forward alone: one bare forward over the long prompt; a decode step with a dynamic cache. Not with the
    # compiled layers: they are compiled for the engine's cache, so a forward with another would time a recompilation.
    ids = torch.tensor([long_prompt], device=device)
    if not result["compiled"]:
        with torch.inference_mode():
            forwards, steps = [], []
            for _ in range(args.repeats + 1):
                sync(device)
                started = time.perf_counter()
                cache = model(input_ids=ids, use_cache=True, logits_to_keep=1).past_key_values
                sync(device)
                forwards.append(time.perf_counter() - started)
            one = torch.tensor([[5]], device=device)
            for _ in range(20):
                sync(device)
                started = time.perf_counter()
                model(input_ids=one, past_key_values=cache, use_cache=True)
                sync(device)
                steps.append(time.perf_counter() - started)
                cache.crop(-1)
        result["bare_forward_s"] = statistics.median(forwards[1:])
        result["eager_decode_step_s"] = statistics.median(steps[5:])

    # The engine's own prefill forward over the same prompt (slot 0, as the first request gets), outside its loop.
    prefills = []
    with torch.inference_mode():
        for _ in range(args.repeats + 1):
            sync(device)
            started = time.perf_counter()
            engine._runner._prompt_forward([PromptRow(0, long_prompt, 0, False)])
            sync(device)
            prefills.append(time.perf_counter() - started)
    result["engine_prefill_forward_s"] = statistics.median(prefills[1:])
    # Many short prompts arriving together: one eager forward over as many as a prefill chunk holds.
    group = min(engine.max_batch, engine.config.prefill_chunk // (len(short) + 1))
    group_rows = [PromptRow(i, (*short, i % vocab), 0, False) for i in range(group)]
    groups = []
    with torch.inference_mode():
        for _ in range(args.repeats + 1):
            sync(device)
            started = time.perf_counter()
            engine._runner._prompt_forward(group_rows)
            sync(device)
            groups.append(time.perf_counter() - started)
    result[f"engine_group_prefill_{group}x{len(short) + 1}_s"] = statistics.median(groups[1:])
    if args.profile:
        profile(
            args.profile,
            {
                "engine_prefill_forward": lambda: engine._runner._prompt_forward([PromptRow(0, long_prompt, 0, False)]),
                "engine_decode_step_eager_all_rows": lambda: eager_decode(engine, engine.max_batch, args.prompt_tokens),
                "engine_ttft": lambda: first_token(engine, long_prompt),
                "engine_group_prefill": lambda: engine._runner._prompt_forward(group_rows),
            },
            device,
        )

    if engine._runner.graphs is not None:  # the engine's own CUDA graphs, launched back to back (no host work between)
        greedy, chat = SamplerFeatures(), SamplerFeatures(filters=True)
        result["graph_step_s"] = graph_step_ms(engine, 1, args.prompt_tokens + 1, args.repeats, greedy) / 1e3
        span = len(short) + 1 + args.tokens  # as the concurrent runs below end
        for name, features in (("greedy", greedy), ("chat", chat)):
            result[f"graph_step_ms_by_rows_{name}"] = {
                str(rows): graph_step_ms(engine, rows, span, args.repeats, features)
                for rows in engine._runner.graphs.row_buckets
                if rows <= max(concurrency)
            }

    run_streams(engine, [short], args.tokens)  # warm-up
    ttft = []
    for _ in range(args.repeats):
        started = time.perf_counter()
        first_token(engine, long_prompt)
        ttft.append(time.perf_counter() - started)
    result["engine_ttft_s"] = statistics.median(ttft)
    if "bare_forward_s" in result:
        result["engine_ttft_over_bare_forward"] = result["engine_ttft_s"] / result["bare_forward_s"]
    result["engine_decode_tok_s"] = statistics.median(run_streams(engine, [short], args.tokens)[1]
                                                      for _ in range(args.repeats))  # fmt: skip
    result["engine_aggregate_tok_s"], result["engine_phases"] = {}, {}
    phases = Phases(engine)
    for count in concurrency:
        prompts = [(*short, i % vocab) for i in range(count)]
        runs = []
        for _ in range(args.repeats):
            phases.reset()
            started = time.perf_counter()
            runs.append(run_streams(engine, prompts, args.tokens)[0])
            result["engine_phases"][str(count)] = phases.summary(time.perf_counter() - started)  # the last run's
        result["engine_aggregate_tok_s"][str(count)] = statistics.median(runs)
    engine.close()
    for key, value in result.items():
        print(f"{key:<32} {value:.4f}" if isinstance(value, float) else f"{key:<32} {value}")
    args.out.mkdir(parents=True, exist_ok=True)
    name = f"step_time_{Path(args.model).stem}_{args.device.replace(':', '')}_{result['card'].replace(' ', '_')}"
    name += "_compiled" if result["compiled"] else ""
    name += f"_{args.quantize}" if args.quantize != "none" else ""
    (args.out / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
