"""A soak of the OpenAI API: --requests streamed chat requests (distinct questions, --concurrency at a time), every
other one dropped by its client after its first content chunk; the worker's resident memory before and after (after
--warm-up requests), against what its host caches report they took meanwhile (/health's prompt_cache_bytes, which
rbee:memory_bytes{part="prompt_cache"} reports too) plus --slack-mib.

    PYTHONPATH=src python bench/soak.py --model demo
"""

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path

import httpx
import psutil

from rbee_worker.benchmark.run import machine, start_worker

TOPICS = ["bees", "rivers", "lighthouses", "bread", "chess", "volcanoes", "tides", "owls", "glass", "maps", "salt"]


def question(i: int) -> list[dict]:
    return [{"role": "user", "content": f"Question {i}: tell me one fact about {TOPICS[i % len(TOPICS)]}."}]


async def chat(client: httpx.AsyncClient, i: int, drop: bool, max_tokens: int) -> None:
    body = {"messages": question(i), "max_tokens": max_tokens, "temperature": 0.7, "top_p": 0.9, "seed": i,
            "stream": True}  # fmt: skip
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if drop and '"content":"' in line and '"content":""' not in line:
                return  # leaving the stream: the worker cancels the request


async def run(url: str, count: int, concurrency: int, max_tokens: int, first: int = 0) -> None:
    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:

        async def one(i: int) -> None:
            async with gate:
                await chat(client, i, drop=i % 2 == 1, max_tokens=max_tokens)

        await asyncio.gather(*(one(first + i) for i in range(count)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="demo")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--warm-up", type=int, default=30)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--slack-mib", type=float, default=64.0)
    parser.add_argument("--worker-flag", action="append", default=[], help="passed to `rbee-worker serve` as is")
    parser.add_argument("--out", type=Path, default=Path("bench/results/soak"))
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        worker_args = argparse.Namespace(model=args.model, device=args.device, dtype=args.dtype,
                                         concurrency=[args.concurrency], worker_flag=args.worker_flag)  # fmt: skip
        process, url, _ = start_worker(worker_args, Path(tmp) / "worker.log")
        try:
            asyncio.run(run(url, args.warm_up, args.concurrency, args.max_tokens, first=10_000))
            rss = psutil.Process(process.pid).memory_info().rss
            cached = httpx.get(f"{url}/health").json()["prompt_cache_bytes"]
            started = time.monotonic()
            asyncio.run(run(url, args.requests, args.concurrency, args.max_tokens))
            elapsed = time.monotonic() - started
            time.sleep(1)  # the dropped requests' cancellations land
            health = httpx.get(f"{url}/health").json()
            rss_after = psutil.Process(process.pid).memory_info().rss
            metrics = httpx.get(f"{url}/metrics").text
        finally:
            process.terminate()
            process.wait(60)
    reported = next(line for line in metrics.splitlines() if 'part="prompt_cache"' in line)
    growth, cache_growth = rss_after - rss, health["prompt_cache_bytes"] - cached
    bound = max(cache_growth, 0) + args.slack_mib * 2**20
    result = {
        "machine": machine(),
        "model": args.model,
        "requests": args.requests,
        "dropped": args.requests // 2,
        "seconds": round(elapsed, 1),
        "rss_before_mib": rss / 2**20,
        "rss_after_mib": rss_after / 2**20,
        "rss_growth_mib": growth / 2**20,
        "prompt_cache_growth_mib": cache_growth / 2**20,
        "prompt_cache_reported_in_metrics": float(reported.rsplit(" ", 1)[1]) == health["prompt_cache_bytes"],
        "bound_mib": bound / 2**20,
        "within_bound": growth <= bound,
        "idle_after": health["state"] == "idle",
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"soak_{args.model.replace('/', '_')}.json").write_text(json.dumps(result, indent=2) + "\n")
    print("| requests (half dropped) | s | RSS before MiB | RSS growth MiB | prompt cache growth MiB | bound MiB |")
    print("|---|---|---|---|---|---|")
    mib = [rss, growth, cache_growth, bound]
    print(f"| {args.requests} | {elapsed:.0f} | " + " | ".join(f"{v / 2**20:+.1f}" for v in mib) + " |")
    print(f"within the bound: {growth <= bound}")


if __name__ == "__main__":
    main()
