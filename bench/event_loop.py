"""The HTTP event loop while long prompts are prepared (rendered and tokenized), on this build and on another
(--previous: a src/ directory, e.g. the code before a change) in the same run, each on a fresh worker.

- `stall`: GET /health is polled every 5 ms (each answer comes from the event loop) while one chat request with a
  --prompt-tokens prompt (max_tokens 1) is sent; the longest /health answer in the --window-s after the send (the
  prompt's preparation, then its prefill, which the request's cancellation then ends) against the longest in the
  --window-s before it (median over --repeats distinct prompts).
- `gil` (in this process, no worker): whether the model's tokenizer and chat template release the GIL: the longest
  gap between the main thread's ticks (a 0.5 ms sleep each) while another thread tokenizes a --prompt-tokens text,
  then renders it as a chat message, against the seconds each takes.
- `streams`: --streams greedy streams decode; once all do, --arrivals chat requests with distinct --prompt-tokens
  prompts (max_tokens 1) are sent at once; the streams' inter-token times in the --window-s after the send (the
  arrivals' preparation and their first prompt chunks; a 2-core CPU takes minutes to prefill them all, the same work
  on any build, so they are cancelled then) (p50, p99, max) against the same streams' in the --window-s before it,
  and the longest /health answer.
- `tokenize`: the same, the arrivals sent to POST /tokenize (their chat template rendered and tokenized, nothing
  computed): the preparation alone, which a prefill's inter-token times on a small CPU would hide.

    PYTHONPATH=src python bench/event_loop.py --model demo --device cpu --previous /tmp/old/src \\
        --worker-flag=--kv-cache-gb --worker-flag=8
"""

import argparse
import asyncio
import functools
import itertools
import json
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
from kv_cache import worker

from rbee_worker.benchmark.run import TEXT, machine, tokenizer_of
from rbee_worker.loading.loader import resolve_model_path

PROBE_EVERY_S = 0.005
CASES = ("gil", "stall", "streams", "tokenize")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="demo")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--previous", type=Path, help="a src/ directory of another build to measure alongside")
    parser.add_argument("--prompt-tokens", type=int, default=8000)
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--arrivals", type=int, default=16)
    parser.add_argument("--window-s", type=float, default=10.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES))
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


async def chat(client: httpx.AsyncClient, text: str) -> None:
    """One chat request, max_tokens 1."""
    body = {"messages": [{"role": "user", "content": text}], "max_tokens": 1, "temperature": 0}
    (await client.post("/v1/chat/completions", json=body)).raise_for_status()


async def tokenize(client: httpx.AsyncClient, text: str) -> None:
    """The chat request's preparation alone."""
    (await client.post("/tokenize", json={"messages": [{"role": "user", "content": text}]})).raise_for_status()


async def for_a_while(coroutines: list, seconds: float) -> None:
    """`seconds` pass while the requests run; those still running then are cancelled (the client leaves: the worker
    cancels them)."""
    tasks = [asyncio.ensure_future(c) for c in coroutines]
    started = time.perf_counter()
    _, pending = await asyncio.wait(tasks, timeout=seconds)
    for task in pending:
        task.cancel()
    for result in await asyncio.gather(*tasks, return_exceptions=True):
        if isinstance(result, httpx.HTTPError):
            raise result
    await asyncio.sleep(max(0.0, seconds - (time.perf_counter() - started)))


async def stall(url: str, args: argparse.Namespace) -> dict:
    async with httpx.AsyncClient(base_url=url, timeout=600) as client, httpx.AsyncClient(base_url=url) as probing:
        probe = Probe(probing)
        polling = asyncio.ensure_future(probe.run())
        during, before = [], []
        for repeat in range(args.repeats):
            text = await long_prompt(client, args.prompt_tokens, repeat)
            await asyncio.sleep(args.window_s)  # a window with nothing sent
            start = time.perf_counter()
            await for_a_while([chat(client, text)], args.window_s)
            during.append(probe.longest(start, start + args.window_s))
            before.append(probe.longest(start - args.window_s, start))
        probe.running = False
        await polling
    return {"health_longest_s": statistics.median(during), "health_longest_idle_s": statistics.median(before)}


def gil(args: argparse.Namespace) -> dict:
    tokenizer = tokenizer_of(resolve_model_path(args.model))
    unit = TEXT + "\n"
    text = unit * max(1, args.prompt_tokens // len(tokenizer(unit)["input_ids"]))
    messages = [{"role": "user", "content": text}]
    out = {"tokens": len(tokenizer(text)["input_ids"])}
    for name, work in (
        ("tokenize", lambda: tokenizer(text)),
        ("render", lambda: tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)),
    ):
        gaps, done = [], threading.Event()

        def run(work: Callable[[], object] = work, done: threading.Event = done) -> None:
            work()
            done.set()

        thread = threading.Thread(target=run)
        started = last = time.perf_counter()
        thread.start()
        while not done.is_set():
            time.sleep(0.0005)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now
        thread.join()
        out[name] = {"seconds": time.perf_counter() - started, "longest_gap_s": max(gaps)}
    return out


async def stream(client: httpx.AsyncClient, times: list[float], tokens: int) -> None:
    body = {"prompt": f"Story {len(times)}: " + TEXT[:200], "max_tokens": tokens, "ignore_eos": True, "stream": True}
    async with client.stream("POST", "/v1/completions", json=body) as response:
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                times.append(time.perf_counter())


def gaps(timelines: list[list[float]], start: float, end: float) -> list[float]:
    """Each token's time since the stream's token before it, for the tokens that arrive within (start, end]."""
    return [b - a for times in timelines for a, b in itertools.pairwise(times) if start < b <= end]


def spread(gaps: list[float]) -> dict:
    values = sorted(gaps) or [float("nan")]
    return {
        "tokens": len(gaps),
        "p50_ms": 1000 * values[len(values) // 2],
        "p99_ms": 1000 * values[int(len(values) * 0.99)],
        "max_ms": 1000 * values[-1],
    }


async def streams(url: str, args: argparse.Namespace, arrive: Callable = chat) -> dict:
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
            await asyncio.sleep(args.window_s)
            start = time.perf_counter()
            await for_a_while([arrive(client, text) for text in texts], args.window_s)
            end = start + args.window_s
            probe.running = False
            await polling
        for task in running:
            task.cancel()
        await asyncio.gather(*running, return_exceptions=True)
    return {
        "during": spread(gaps(timelines, start, end)),
        "before": spread(gaps(timelines, start - args.window_s, start)),
        "health_longest_s": probe.longest(start, end),
    }


def main() -> None:
    args = parse_args()
    builds = [("this", None)] + ([("previous", args.previous)] if args.previous else [])
    results: dict = {"machine": machine(), "args": {k: str(v) for k, v in vars(args).items()}}
    if "gil" in args.cases:
        results["gil"] = gil(args)
        print(json.dumps({"gil": results["gil"]}), flush=True)
    served = [case for case in CASES[1:] if case in args.cases]
    with tempfile.TemporaryDirectory() as work:
        for name, src in builds if served else []:
            process, url = worker(args, Path(work) / f"{name}.log", src, args.worker_flag)
            try:
                cases = {"stall": stall, "streams": streams, "tokenize": functools.partial(streams, arrive=tokenize)}
                results[name] = {case: asyncio.run(cases[case](url, args)) for case in served}
            finally:
                process.terminate()
                process.wait(60)
            print(json.dumps({name: results[name]}, indent=1), flush=True)
    if served == list(CASES[1:]):
        table(results, builds, args)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{args.model.replace('/', '_')}_{args.device}_{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(results, indent=1))
    print(f"saved {path}")


def table(results: dict, builds: list, args: argparse.Namespace) -> None:
    print(f"| build | /health longest while one {args.prompt_tokens}-token prompt (idle) | ITL p50 / p99 / max ms "
          f"while {args.arrivals} arrive (before) | the same, arriving at /tokenize |")  # fmt: skip
    print("|---|---|---|---|")

    def itl(case: dict) -> str:
        during, before = case["during"], case["before"]
        return (
            f"{during['p50_ms']:.0f} / {during['p99_ms']:.0f} / {during['max_ms']:.0f} "
            f"({before['p50_ms']:.0f} / {before['p99_ms']:.0f} / {before['max_ms']:.0f})"
        )

    for name, _ in builds:
        s = results[name]["stall"]
        print(
            f"| {name} | {1000 * s['health_longest_s']:.1f} ms ({1000 * s['health_longest_idle_s']:.1f}) | "
            f"{itl(results[name]['streams'])} | {itl(results[name]['tokenize'])} |"
        )


if __name__ == "__main__":
    main()
