"""The served worker's `llama_decode` steps against the bare batched loop's: how long each step's forward takes and how
long the host takes between two steps, with HTTP and the streaming client beside the model (bench/llama_cpp_steps.py
splits the engine's step in-process, without them).

The worker is `rbee-worker serve` on the demo (llama.cpp runtime), started through this file so that its
`llama_decode` is timed (`--worker`, internal); --streams concurrent greedy streams of --tokens tokens through
/v1/completions, --repeats times, as `rbee-worker bench` sends them; then llama.cpp's bare batched loop
(benchmark/llama_cpp.py's `batched_decode`, the bench's peer) on the same prompts in this process, timed alike.
For each: the aggregate tokens/s of each run, the count of steps by batch size, the median forward of the steps
that decode every stream, and the median gap between two such steps (the host's own work: sampling, output,
scheduling, and for the worker the events handed to the HTTP thread).

    PYTHONPATH=src python bench/served_steps.py --streams 4 --out bench/results/llama_cpp_steps
"""

import argparse
import asyncio
import itertools
import json
import runpy
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import llama_cpp.llama_cpp as native

from rbee_worker.benchmark.llama_cpp import batched_decode
from rbee_worker.benchmark.run import build_spec, machine, stream_completion
from rbee_worker.server.listener import bind

Step = tuple[float, float, int]  # start, end (perf_counter seconds), tokens in the batch


def time_decode(steps: list[Step]) -> None:
    """Every later `llama_decode` of this process appends its Step to `steps`."""
    original = native.llama_decode

    def timed(context: object, batch: native.llama_batch) -> int:
        started = time.perf_counter()
        code = original(context, batch)
        steps.append((started, time.perf_counter(), batch.n_tokens))
        return code

    native.llama_decode = timed


def run_worker(log: str, serve_args: list[str]) -> None:
    """`rbee-worker serve` in this process with its steps timed; SIGUSR1 writes them to `log` as JSON."""
    steps: list[Step] = []
    time_decode(steps)
    signal.signal(signal.SIGUSR1, lambda *_: Path(log).write_text(json.dumps(steps)))
    sys.argv = ["rbee_worker", "serve", *serve_args]
    runpy.run_module("rbee_worker", run_name="__main__")


def summary(steps: list[Step], streams: int) -> dict:
    full = [s for s in steps if s[2] == streams]
    forward = [1000 * (end - start) for start, end, _ in full]
    ordered = sorted(steps)
    gaps = [
        1000 * (after[0] - before[1])
        for before, after in itertools.pairwise(ordered)
        if before[2] == after[2] == streams and after[0] - before[1] < 0.5  # not across two runs
    ]
    sizes: dict[int, int] = {}
    for _, _, tokens in steps:
        sizes[tokens] = sizes.get(tokens, 0) + 1
    return {
        "steps_by_tokens": dict(sorted(sizes.items())),
        "forward_ms": statistics.median(forward),
        "gap_ms": statistics.median(gaps),
    }


def measure_served(args: argparse.Namespace, spec: dict, prompts: list[list[int]]) -> dict:
    sock = bind("127.0.0.1", 0)
    port = sock.getsockname()[1]
    sock.close()
    log = Path(tempfile.mkdtemp()) / "steps.json"
    serve = ["--model", args.model, "--port", str(port), "--device", "cpu", "--max-batch", str(args.streams)]
    process = subprocess.Popen(
        [sys.executable, __file__, "--worker", str(log), *serve],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"

    def steps() -> list[Step]:
        process.send_signal(signal.SIGUSR1)
        time.sleep(0.5)
        return json.loads(log.read_text())

    async def runs() -> list[float]:
        rates = []
        for _ in range(args.repeats):
            streams = await asyncio.gather(*(stream_completion(url, p, args.tokens, spec["sampling"]) for p in prompts))
            wall = max(s.ended for s in streams) - min(s.started for s in streams)
            rates.append(sum(s.tokens for s in streams) / wall)
        return rates

    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        asyncio.run(stream_completion(url, spec["short_prompt"], args.tokens, spec["sampling"]))  # a warm-up
        before = len(steps())  # the start-up's and the warm-up's steps
        rates = asyncio.run(runs())
        timed = steps()[before:]
    finally:
        process.terminate()
        process.wait(timeout=60)
    return {"tok_s": rates, **summary(timed, args.streams)}


def main() -> None:
    if sys.argv[1:2] == ["--worker"]:
        run_worker(sys.argv[2], sys.argv[3:])
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="demo", help="a GGUF file (default: the demo)")
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("bench/results/llama_cpp_steps"))
    args = parser.parse_args()
    spec_args = argparse.Namespace(
        model=args.model, prompt_tokens=16, gen_tokens=args.tokens, concurrency=[args.streams], sampling="greedy",
        repeats=args.repeats, threads=args.threads,
    )  # fmt: skip
    spec = build_spec(spec_args)
    prompts = [spec["short_prompt"] + [i] for i in spec["distinct_ids"][: args.streams]]
    result = {"machine": machine(), "args": {k: str(v) for k, v in vars(args).items()}}
    result["served"] = measure_served(args, spec, prompts)
    steps: list[Step] = []
    time_decode(steps)
    rates = [
        batched_decode(spec_args.model_path, args.threads, prompts, args.tokens, None).aggregate_tok_s
        for _ in range(args.repeats)
    ]
    result["bare"] = {"tok_s": rates, **summary(steps, args.streams)}
    for name in ("served", "bare"):
        row = result[name]
        print(
            f"{name}: tok/s {' / '.join(f'{r:.1f}' for r in row['tok_s'])}, steps {row['steps_by_tokens']}, "
            f"forward {row['forward_ms']:.2f} ms, gap {row['gap_ms']:.3f} ms"
        )
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out / f"served_steps_{args.streams}_{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(json.dumps(result, indent=1))
    print(f"saved {out}")


if __name__ == "__main__":
    main()
