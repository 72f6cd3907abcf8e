"""The HTTP event loop while long prompts are prepared (rendered and tokenized), on this build and on another
(--previous: a src/ directory, e.g. the code before a change) in the same run, each on a fresh worker.

- `stall`: GET /health is polled every 5 ms (each answer comes from the event loop) while one chat request with a
  --prompt-tokens prompt (max_tokens 1) is sent; the longest /health answer during it against the longest in as long
  a window before it (median over --repeats distinct prompts).
- `streams`: --streams greedy streams decode; once all do, --arrivals chat requests with distinct --prompt-tokens
  prompts (max_tokens 1) are sent at once; the streams' inter-token times from the send until the last arrival's
  answer (p50, p99, max) against the same streams' in the --baseline-s before it, and the longest /health answer.

    PYTHONPATH=src python bench/event_loop.py --model demo --device cpu --previous /tmp/old/src \\
        --worker-flag=--kv-cache-gb --worker-flag=8
"""

import argparse
import asyncio
import itertools
import json
import statistics
import tempfile
import time
from pathlib import Path

import httpx
from kv_cache import worker

from rbee_worker.benchmark.run import TEXT, machine

PROBE_EVERY_S = 0.005


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="demo")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--previous", type=Path, help="a src/ directory of another build to measure alongside")
    parser.add_argument("--prompt-tokens", type=int, default=8000)
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--arrivals", type=int, default=16)
    parser.add_argument("--baseline-s", type=float, default=3.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--worker-flag", action="append", default=[], help="a flag for the worker (repeatable)")
    parser.add_argument("--out", type=Path, default=Path("bench/results/event_loop"))
    args = parser.parse_args(argv)
    args.max_batch = args.streams + args.arrivals
    return args


class Probe:
    """GET /health every PROBE_EVERY_S; each answer's (start, seconds)."""

    def __init__(self, client: httpx.AsyncClient) -> None:
        self.client, self.answers, self.running = client, [], True

    async def run(self) -> None:
        while self.running:
            started = time.perf_counter()
            await self.client.get("/health")
            self.answers.append((started, time.perf_counter() - started))
            await asyncio.sleep(PROBE_EVERY_S)

    def longest(self, start: float, end: float) -> float:
        return max((s for t, s in self.answers if start <= t <= end), default=float("nan"))


async def long_prompt(client: httpx.AsyncClient, tokens: int, tag: int) -> str:
    """A text of about `tokens` tokens (counted by the worker), beginning with its own tag."""
    unit = TEXT + "\n"
    counted = len((await client.post("/tokenize", json={"prompt": unit})).json()["tokens"])
    return f"Request {tag}. " + unit * max(1, tokens // counted - 1)


async def chat(client: httpx.AsyncClient, text: str) -> float:
    """One chat request, max_tokens 1: the seconds to its answer."""
    started = time.perf_counter()
    body = {"messages": [{"role": "user", "content": text}], "max_tokens": 1, "temperature": 0}
    (await client.post("/v1/chat/completions", json=body)).raise_for_status()
    return time.perf_counter() - started


async def stall(url: str, args: argparse.Namespace) -> dict:
    async with httpx.AsyncClient(base_url=url, timeout=600) as client, httpx.AsyncClient(base_url=url) as probing:
        probe = Probe(probing)
        polling = asyncio.ensure_future(probe.run())
        during, before = [], []
        for repeat in range(args.repeats):
            text = await long_prompt(client, args.prompt_tokens, repeat)
            start = time.perf_counter()
            seconds = await chat(client, text)
            await asyncio.sleep(seconds)  # as long a window with nothing sent
            during.append(probe.longest(start, start + seconds))
            before.append(probe.longest(start + seconds, time.perf_counter()))
        probe.running = False
        await polling
    return {"health_longest_s": statistics.median(during), "health_longest_idle_s": statistics.median(before)}


async def stream(client: httpx.AsyncClient, times: list[float], tokens: int) -> None:
    body = {"prompt": f"Story {len(times)}: " + TEXT[:200], "max_tokens": tokens, "ignore_eos": True, "stream": True}
    async with client.stream("POST", "/v1/completions", json=body) as response:
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                times.append(time.perf_counter())


def gaps(timelines: list[list[float]], start: float, end: float) -> list[float]:
    return [b - a for times in timelines for a, b in itertools.pairwise(times) if start <= a and b <= end]


def spread(values: list[float]) -> dict:
    values = sorted(values)
    return {
        "p50_ms": 1000 * values[len(values) // 2],
        "p99_ms": 1000 * values[int(len(values) * 0.99)],
        "max_ms": 1000 * values[-1],
    }


async def streams(url: str, args: argparse.Namespace) -> dict:
    limits = httpx.Limits(max_connections=args.streams + args.arrivals + 4)
    async with httpx.AsyncClient(base_url=url, timeout=1800, limits=limits) as client:
        texts = [await long_prompt(client, args.prompt_tokens, 100 + i) for i in range(args.arrivals)]
        timelines: list[list[float]] = [[] for _ in range(args.streams)]
        running = [asyncio.ensure_future(stream(client, times, 4000)) for times in timelines]
        while not all(timelines):
            await asyncio.sleep(0.05)
        async with httpx.AsyncClient(base_url=url) as probing:
            probe = Probe(probing)
            polling = asyncio.ensure_future(probe.run())
            await asyncio.sleep(args.baseline_s)
            start = time.perf_counter()
            await asyncio.gather(*(chat(client, text) for text in texts))
            end = time.perf_counter()
            probe.running = False
            await polling
        for task in running:
            task.cancel()
        await asyncio.gather(*running, return_exceptions=True)
    return {
        "arrivals_s": end - start,
        "during": spread(gaps(timelines, start, end)),
        "before": spread(gaps(timelines, start - args.baseline_s, start)),
        "health_longest_s": probe.longest(start, end),
    }


def main() -> None:
    args = parse_args()
    builds = [("this", None)] + ([("previous", args.previous)] if args.previous else [])
    results: dict = {"machine": machine(), "args": {k: str(v) for k, v in vars(args).items()}}
    with tempfile.TemporaryDirectory() as work:
        for name, src in builds:
            process, url = worker(args, Path(work) / f"{name}.log", src, args.worker_flag)
            try:
                results[name] = {"stall": asyncio.run(stall(url, args)), "streams": asyncio.run(streams(url, args))}
            finally:
                process.terminate()
                process.wait(60)
            print(json.dumps({name: results[name]}, indent=1), flush=True)
    print(f"| build | /health longest while one {args.prompt_tokens}-token prompt (idle) | ITL p50 / p99 / max ms "
          f"while {args.arrivals} arrive (before) | /health longest then |")  # fmt: skip
    print("|---|---|---|---|")
    for name, _ in builds:
        s, m = results[name]["stall"], results[name]["streams"]
        during, before = m["during"], m["before"]
        print(
            f"| {name} | {1000 * s['health_longest_s']:.1f} ms ({1000 * s['health_longest_idle_s']:.1f}) | "
            f"{during['p50_ms']:.0f} / {during['p99_ms']:.0f} / {during['max_ms']:.0f} "
            f"({before['p50_ms']:.0f} / {before['p99_ms']:.0f} / {before['max_ms']:.0f}) | "
            f"{1000 * m['health_longest_s']:.0f} ms |"
        )
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{args.model.replace('/', '_')}_{args.device}_{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(results, indent=1))
    print(f"saved {path}")


if __name__ == "__main__":
    main()
