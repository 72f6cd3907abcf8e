"""What a JSON schema costs a stream: decode tokens/s of chat requests constrained by a schema against the same
requests unconstrained, on one worker, through HTTP, greedy and sampled (temperature 0.7, top_p 0.9).

Each round sends, one at a time and in alternation, an unconstrained request (`ignore_eos`: it decodes exactly
--max-tokens) and the same request with `response_format` json_schema (a list of --items objects with enums, an
integer range, a bounded array, a string pattern and a nested object: it ends where its JSON does, at about the same
length). With --streams N, N - 1 unconstrained requests run beside each measured one, and the measured rate is the
unconstrained neighbours' (what one constrained row costs the rows beside it) against N unconstrained. Decode
tokens/s: (completion tokens - 1) over the time from the first content chunk to the last. The grammar's compile time
and the mask time per token come from /metrics. The ratio is the median constrained rate over the median
unconstrained one.

    PYTHONPATH=src python bench/structured_output.py --model demo --device cpu --runtime llama.cpp
    PYTHONPATH=src python bench/structured_output.py --model demo --device cpu --runtime torch --streams 4
"""

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from rbee_worker.benchmark.peers import SAMPLING
from rbee_worker.benchmark.run import machine, start_worker
from rbee_worker.cpu_features import cpu_features

ITEM = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[A-Z][a-z]{2,8}$"},
        "age": {"type": "integer", "minimum": 18, "maximum": 99},
        "color": {"enum": ["red", "green", "blue"]},
        "pets": {"type": "array", "items": {"enum": ["cat", "dog", "bee"]}, "minItems": 1, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["city", "zip"],
        },
    },
    "required": ["name", "age", "color", "pets", "address"],
}
NAMED_FLAGS = {"avx2", "fma", "f16c", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16", "amx_int8"}
ASK = "Describe some people as a JSON list: name, age, favourite color, pets, address."


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="demo")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--runtime", default="auto", help="the worker's --runtime")
    parser.add_argument("--streams", type=int, default=1, help="requests at once (the measured one among them)")
    parser.add_argument("--items", type=int, default=4, help="objects in the schema's list")
    parser.add_argument("--max-tokens", type=int, default=200, help="the unconstrained requests' length")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--worker-flag", action="append", default=[], help="an extra flag for the worker")
    parser.add_argument("--out", type=Path, default=Path("bench/results/structured_output"))
    return parser.parse_args(argv)


def schema(items: int) -> dict:
    return {"type": "array", "items": ITEM, "minItems": items, "maxItems": items}


async def timed(client: httpx.AsyncClient, body: dict) -> dict:
    """One streamed chat request: its decode rate, completion tokens and finish reason."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    first = last = 0.0
    usage, finish, text = {}, None, []
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices", []):
                finish = choice.get("finish_reason") or finish
                if choice["delta"].get("content"):
                    last = time.perf_counter()
                    first = first or last
                    text.append(choice["delta"]["content"])
    tokens = usage["completion_tokens"]
    return {"rate": (tokens - 1) / (last - first), "tokens": tokens, "finish": finish, "text": "".join(text)}


async def round_of(url: str, bodies: dict[str, dict], streams: int) -> dict[str, float]:
    """Each mode's measured rate: its request alone, or (streams > 1) the neighbours' mean rate beside it."""
    rates = {}
    limits = httpx.Limits(max_connections=streams + 4)
    async with httpx.AsyncClient(base_url=url, timeout=1800, limits=limits) as client:
        for mode, body in bodies.items():
            neighbours = [bodies["unconstrained"]] * (streams - 1)
            results = await asyncio.gather(*(timed(client, b) for b in [body, *neighbours]))
            if results[0]["finish"] == "length" and mode == "json_schema":
                raise SystemExit(f"error: the constrained output did not end within max_tokens: {results[0]['text']}")
            rates[mode] = results[0]["rate"] if streams == 1 else statistics.mean(r["rate"] for r in results[1:])
            rates[f"{mode}_tokens"] = results[0]["tokens"]
    return rates


def metrics(url: str) -> dict[str, float]:
    values = {}
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        if line.startswith("rbee:grammar_"):
            name, value = line.split("{")[0], float(line.rsplit(" ", 1)[1])
            values[name] = value
    return values


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    worker_args = argparse.Namespace(
        model=args.model,
        device=args.device,
        dtype=args.dtype,
        concurrency=[args.streams],
        worker_flag=["--runtime", args.runtime, *args.worker_flag],
    )
    with tempfile.TemporaryDirectory() as work:
        process, url, _ = start_worker(worker_args, Path(work) / "worker.log")
        try:
            model = httpx.get(f"{url}/v1/models", timeout=60).json()["data"][0]["id"]
            runtime = httpx.get(f"{url}/health", timeout=30).json().get("runtime", args.runtime)
            isa = {"isa": cpu_features().isa, "flags": sorted(cpu_features().flags & NAMED_FLAGS)}
            result: dict = {
                "machine": machine() | isa,
                "runtime": runtime,
                "args": vars(args) | {"out": str(args.out)},
            }
            format_ = {"type": "json_schema", "json_schema": {"name": "people", "schema": schema(args.items)}}
            for traffic, sampling in SAMPLING.items():
                common = {"model": model, "messages": [{"role": "user", "content": ASK}], **sampling}
                bodies = {
                    "unconstrained": {**common, "max_tokens": args.max_tokens, "ignore_eos": True},
                    "json_schema": {**common, "max_tokens": 4 * args.max_tokens, "response_format": format_},
                }
                before = metrics(url)
                asyncio.run(round_of(url, bodies, args.streams))  # warm-up: compiles the grammar, fills caches
                compiled = metrics(url)
                rounds = [asyncio.run(round_of(url, bodies, args.streams)) for _ in range(args.repeats)]
                after = metrics(url)
                masks = after["rbee:grammar_masks_total"] - compiled["rbee:grammar_masks_total"]
                mask_s = after["rbee:grammar_mask_seconds_total"] - compiled["rbee:grammar_mask_seconds_total"]
                plain = statistics.median(r["unconstrained"] for r in rounds)
                constrained = statistics.median(r["json_schema"] for r in rounds)
                result[traffic] = {
                    "unconstrained_tok_s": plain,
                    "json_schema_tok_s": constrained,
                    "ratio": constrained / plain,
                    "json_schema_tokens": statistics.median(r["json_schema_tokens"] for r in rounds),
                    "compile_s": compiled["rbee:grammar_compile_seconds_total"]
                    - before["rbee:grammar_compile_seconds_total"],
                    "cache_hits": after["rbee:grammar_cache_hits_total"] - compiled["rbee:grammar_cache_hits_total"],
                    "mask_us_per_token": 1e6 * mask_s / masks if masks else None,
                    "rounds": rounds,
                }
        finally:
            process.terminate()
            process.wait(60)
    print_table(result, args)
    cpu = result["machine"]["gpu" if args.device.startswith("cuda") else "cpu"].split()[0]
    args.out.mkdir(parents=True, exist_ok=True)
    name = f"{args.model.replace('/', '_')}_{args.device}_{runtime}_{cpu}_streams{args.streams}.json"
    (args.out / name).write_text(json.dumps(result, indent=1))
    print(f"saved {args.out / name}")
    return 0


def print_table(result: dict, args: argparse.Namespace) -> None:
    print(f"\n{args.model} on {args.device} ({result['runtime']}), {result['machine']}, streams {args.streams}")
    print("| traffic | unconstrained tok/s | json_schema tok/s | ratio | compile s | cache hits | mask us/token |")
    print("|---|---|---|---|---|---|---|")
    for traffic in SAMPLING:
        row = result[traffic]
        mask = row["mask_us_per_token"]
        print(
            f"| {traffic} | {row['unconstrained_tok_s']:.1f} | {row['json_schema_tok_s']:.1f} | {row['ratio']:.3f} "
            f"| {row['compile_s']:.3f} | {row['cache_hits']:.0f} | {'-' if mask is None else f'{mask:.1f}'} |"
        )


if __name__ == "__main__":
    raise SystemExit(main())
