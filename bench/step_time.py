"""Where a decode step's time goes, below the HTTP API: the model's forward alone, the engine driven directly
(no HTTP), for one stream and for N concurrent ones; and time to first token inside the engine against one bare
forward over the same prompt. Meant for GPUs: on a CPU the forwards timed here run on a second thread, at
about half speed (see engine.py). Set beside `rbee-worker bench` (the same figures through HTTP), the differences say
how much the HTTP layer, the engine's host work and the forward each cost.

    python bench/step_time.py --model M --device cuda|cpu --dtype bfloat16 [--threads 2] [--concurrency 1,16,64]
        [--compile] [--profile DIR]

Prints a table and writes bench/results/step_time_<model>_<device>_<card or cpu>.json (medians of --repeats).
"""

import argparse
import json
import logging
import statistics
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

from rbee_worker.benchmark.run import cpu_name
from rbee_worker.devices import resolve_placement
from rbee_worker.engine.engine import Engine
from rbee_worker.engine.kv_cache import decode_mask
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


def first_token(engine: Engine, prompt: tuple[int, ...]) -> Token:
    """A request for one greedy token through the engine's loop, as a client sees it."""
    request = Request(prompt, max_tokens=1, sampling=SamplingParams(temperature=0))
    return next(e for e in engine.stream(request) if isinstance(e, Token))


def eager_decode(engine: Engine, rows: int, length: int) -> torch.Tensor:
    """One decode step of the engine's forward without its graphs: `rows` rows reading `length` cached positions."""
    device = engine.loaded.info.device
    positions = torch.full((rows, 1), length, device=device)
    engine._cache.prepare(0, positions, length + 1)
    lengths = torch.full((rows,), length + 1, device=device)
    mask = decode_mask(lengths, length + 1, engine.loaded.info.dtype)
    return engine._forward(torch.zeros(rows, 1, dtype=torch.long, device=device), positions, mask)


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
    parser.add_argument("--compile", action="store_true", help="the engine's --compile (torch.compile in the graphs)")
    parser.add_argument("--profile", type=Path, help="also write torch.profiler kernel tables to this folder")
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")  # the engine's start-up steps
    if args.threads:
        torch.set_num_threads(args.threads)
    concurrency = [int(c) for c in args.concurrency.split(",")]
    placement = resolve_placement(args.device, args.dtype)
    engine = Engine(lambda: load_model(args.model, placement), max_batch=max(concurrency), compile_model=args.compile)
    loaded = engine.loaded  # after the cache and the graphs
    device, model = loaded.info.device, loaded.model
    vocab = len(loaded.tokenizer)
    long_prompt = tuple(range(1000, 1000 + args.prompt_tokens))
    short = tuple(range(2000, 2016))
    result: dict = {"model": args.model, "device": args.device, "dtype": args.dtype, "torch": torch.__version__}
    result["compiled"] = engine._forward_module is not model
    result["card"] = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name()

    # The forward alone: one bare forward over the long prompt; a decode step with a dynamic cache.
    ids = torch.tensor([long_prompt], device=device)
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
            engine._prompt_forward([0], [(long_prompt, 0)])
            sync(device)
            prefills.append(time.perf_counter() - started)
    result["engine_prefill_forward_s"] = statistics.median(prefills[1:])
    if args.profile:
        profile(
            args.profile,
            {
                "bare_forward": lambda: model(input_ids=ids, use_cache=True, logits_to_keep=1),
                "engine_prefill_forward": lambda: engine._prompt_forward([0], [(long_prompt, 0)]),
                "engine_decode_step_eager_all_rows": lambda: eager_decode(engine, engine.max_batch, args.prompt_tokens),
                "engine_ttft": lambda: first_token(engine, long_prompt),
            },
            device,
        )

    graphs = engine._graphs  # the engine's own CUDA graphs, replayed back to back (no host work between them)
    if graphs is not None:
        replays = []
        for _ in range(args.repeats):
            sync(device)
            started = time.perf_counter()
            with torch.inference_mode():  # the graphs' static inputs are inference tensors
                for _ in range(50):
                    graphs.run([5], [args.prompt_tokens], [args.prompt_tokens + 1])
            sync(device)
            replays.append((time.perf_counter() - started) / 50)
        result["graph_step_s"] = statistics.median(replays)

    run_streams(engine, [short], args.tokens)  # warm-up
    ttft = []
    for _ in range(args.repeats):
        started = time.perf_counter()
        first_token(engine, long_prompt)
        ttft.append(time.perf_counter() - started)
    result["engine_ttft_s"] = statistics.median(ttft)
    result["engine_ttft_over_bare_forward"] = result["engine_ttft_s"] / result["bare_forward_s"]
    result["engine_decode_tok_s"] = statistics.median(run_streams(engine, [short], args.tokens)[1]
                                                      for _ in range(args.repeats))  # fmt: skip
    result["engine_aggregate_tok_s"] = {}
    for count in concurrency:
        prompts = [(*short, i % vocab) for i in range(count)]
        result["engine_aggregate_tok_s"][str(count)] = statistics.median(
            run_streams(engine, prompts, args.tokens)[0] for _ in range(args.repeats)
        )
    engine.close()
    for key, value in result.items():
        print(f"{key:<32} {value:.4f}" if isinstance(value, float) else f"{key:<32} {value}")
    args.out.mkdir(parents=True, exist_ok=True)
    name = f"step_time_{Path(args.model).stem}_{args.device.replace(':', '')}_{result['card'].replace(' ', '_')}"
    name += "_compiled" if result["compiled"] else ""
    (args.out / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
