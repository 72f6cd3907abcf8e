"""What a JSON schema costs a stream: decode tokens/s of chat requests constrained by a schema against the same
requests unconstrained, on one worker, through HTTP, greedy and sampled (temperature 0.7, top_p 0.9).

Each round sends, in alternation, unconstrained requests (`ignore_eos`: each decodes exactly --max-tokens) and the
same requests with `response_format` json_schema (a list of --items objects with enums, an integer range, a bounded
array, a string pattern and a nested object: it ends where its JSON does, at about the same length). Cases, for each
count N in --streams:

- `one` (N = 1): one request alone, constrained against unconstrained;
- `beside` (N > 1): one request among N - 1 unconstrained ones; the measured rate is the unconstrained neighbours'
  (what one constrained row costs the rows beside it) against N unconstrained;
- `all` (N > 1): N constrained requests at once against N unconstrained.

A rate is decode tokens/s of a request ((completion tokens - 1) over the time from its first content chunk to its
last), averaged over the measured requests of a round; the ratio is the median constrained rate over --repeats rounds
over the median unconstrained one. `steady_ratio` is the same ratio over the part of each round in which every request
of it has its first token and no measured one has ended: what a constrained row costs the step loop once running,
apart from the start (the requests' arrival, their prefills). The grammar's compile time and the mask time per token
come from /metrics.

    PYTHONPATH=src python bench/structured_output.py --model demo --device cpu --runtime llama.cpp
    PYTHONPATH=src python bench/structured_output.py --model demo --device cpu --runtime torch --streams 4
    PYTHONPATH=src python bench/structured_output.py --model /tmp/m8b --device cuda --dtype bfloat16 --streams 1 64
"""

import argparse
import asyncio
import itertools
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from rbee_worker.benchmark.peers import SAMPLING
from rbee_worker.benchmark.run import machine, start_worker
from rbee_worker.hardware.cpu_features import cpu_features

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
    parser.add_argument("--streams", type=int, nargs="+", default=[1], help="requests at once (cases above)")
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
    usage, finish, text, times = {}, None, [], []
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
                    times.append(last)
    tokens = usage["completion_tokens"]
    rate = (tokens - 1) / (last - first)
    return {"rate": rate, "tokens": tokens, "finish": finish, "text": "".join(text), "times": times}


def steady_rate(results: list[dict], measured: list[dict]) -> float:
    """Tokens per second and measured request, from the last first chunk of all `results` to the first last chunk of
    the `measured` ones: each request's content chunks in that window, counted at its tokens per chunk (a chunk may
    carry several tokens' text)."""
    start = max(r["times"][0] for r in results)
    end = min(r["times"][-1] for r in measured)
    if end <= start:
        return float("nan")
    tokens = 0.0
    for r in measured:
        per_chunk = (r["tokens"] - 1) / max(1, len(r["times"]) - 1)
        tokens += per_chunk * sum(1 for t in r["times"] if start < t <= end)
    return tokens / (end - start) / len(measured)


async def round_of(url: str, bodies: dict[str, dict], case: str, streams: int) -> dict[str, Any]:
    """Each mode's measured rate in one round of a case (see the module docstring), and its requests' timelines:
    for each request in the order sent, its first and last content chunk (ms after the round's start), its completion
    tokens and the longest wait between two of its chunks (ms)."""
    rates: dict[str, Any] = {}
    limits = httpx.Limits(max_connections=streams + 4)
    for mode, body in bodies.items():
        batch = [body] * streams if case == "all" else [body, *[bodies["unconstrained"]] * (streams - 1)]
        # A client of its own for each mode's batch, on new connections: httpx's pool sends a batch over connections
        # it reuses one request at a time, spread over many engine steps (bench/results/README.md), which would
        # stagger the second mode's arrivals and not the first's.
        async with httpx.AsyncClient(base_url=url, timeout=1800, limits=limits) as client:
            started = time.perf_counter()
            results = await asyncio.gather(*(timed(client, b) for b in batch))
        constrained = results[:1] if case == "beside" else results
        if mode == "json_schema" and (cut := next((r for r in constrained if r["finish"] == "length"), None)):
            raise SystemExit(f"error: the constrained output did not end within max_tokens: {cut['text']}")
        measured = results[1:] if case == "beside" else results
        rates[mode] = statistics.mean(r["rate"] for r in measured)
        rates[f"{mode}_steady"] = steady_rate(results, measured)
        rates[f"{mode}_tokens"] = results[0]["tokens"]
        rates[f"{mode}_timeline"] = [timeline(r, started) for r in results]
    return rates


def timeline(result: dict, started: float) -> list[float]:
    times = result["times"]
    gaps = [b - a for a, b in itertools.pairwise(times)]
    ms = [1000 * (times[0] - started), 1000 * (times[-1] - started), result["tokens"], 1000 * max(gaps, default=0)]
    return [round(value, 1) for value in ms]


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
        concurrency=args.streams,
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
            cases = [("one", 1)] if 1 in args.streams else []
            cases += [(case, n) for n in args.streams if n > 1 for case in ("beside", "all")]
            result["cases"] = [
                {"case": case, "streams": n} | {traffic: measure(url, model, format_, sampling, case, n, args)
                                                for traffic, sampling in SAMPLING.items()}
                for case, n in cases
            ]  # fmt: skip
        finally:
            process.terminate()
            process.wait(60)
    print_table(result, args)
    cpu = result["machine"]["gpu" if args.device.startswith("cuda") else "cpu"].split()[0]
    args.out.mkdir(parents=True, exist_ok=True)
    streams = "-".join(map(str, args.streams))
    name = f"{Path(args.model).name}_{args.device}_{runtime}_{cpu}_streams{streams}.json"
    (args.out / name).write_text(json.dumps(result, indent=1))
    print(f"saved {args.out / name}")
    return 0


def measure(
    url: str, model: str, format_: dict, sampling: dict, case: str, streams: int, args: argparse.Namespace
) -> dict:
    """One case under one kind of traffic: a warm-up round (compiles the grammar), then --repeats timed rounds."""
    common = {"model": model, "messages": [{"role": "user", "content": ASK}], **sampling}
    bodies = {
        "unconstrained": {**common, "max_tokens": args.max_tokens, "ignore_eos": True},
        "json_schema": {**common, "max_tokens": 4 * args.max_tokens, "response_format": format_},
    }
    before = metrics(url)
    asyncio.run(round_of(url, bodies, case, streams))
    compiled = metrics(url)
    rounds = [asyncio.run(round_of(url, bodies, case, streams)) for _ in range(args.repeats)]
    after = metrics(url)
    masks = after["rbee:grammar_masks_total"] - compiled["rbee:grammar_masks_total"]
    mask_s = after["rbee:grammar_mask_seconds_total"] - compiled["rbee:grammar_mask_seconds_total"]
    plain = statistics.median(r["unconstrained"] for r in rounds)
    constrained = statistics.median(r["json_schema"] for r in rounds)
    steady = statistics.median(r["json_schema_steady"] for r in rounds)
    return {
        "unconstrained_tok_s": plain,
        "json_schema_tok_s": constrained,
        "ratio": constrained / plain,
        "steady_ratio": steady / statistics.median(r["unconstrained_steady"] for r in rounds),
        "json_schema_tokens": statistics.median(r["json_schema_tokens"] for r in rounds),
        "compile_s": compiled["rbee:grammar_compile_seconds_total"] - before["rbee:grammar_compile_seconds_total"],
        "cache_hits": after["rbee:grammar_cache_hits_total"] - compiled["rbee:grammar_cache_hits_total"],
        "mask_us_per_token": 1e6 * mask_s / masks if masks else None,
        "rounds": rounds,
    }


def print_table(result: dict, args: argparse.Namespace) -> None:
    print(f"\n{args.model} on {args.device} ({result['runtime']}), {result['machine']}")
    print("| case | streams | traffic | unconstrained tok/s | json_schema tok/s | ratio | steady ratio | compile s |"
          " cache hits | mask us/token |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|")
    for row in result["cases"]:
        for traffic in SAMPLING:
            cell = row[traffic]
            mask = cell["mask_us_per_token"]
            print(
                f"| {row['case']} | {row['streams']} | {traffic} | {cell['unconstrained_tok_s']:.1f} "
                f"| {cell['json_schema_tok_s']:.1f} | {cell['ratio']:.3f} | {cell['steady_ratio']:.3f} "
                f"| {cell['compile_s']:.3f} "
                f"| {cell['cache_hits']:.0f} | {'-' if mask is None else f'{mask:.1f}'} |"
            )


if __name__ == "__main__":
    raise SystemExit(main())
