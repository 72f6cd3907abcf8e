"""The paged KV cache and the prefix cache measured through HTTP: decode speed after short and long prompts against the
bandwidth ceiling, the time to first token of requests that share a prefix with the prefix cache on and off, and
the same cases on another build of the worker (--previous: a src/ directory, e.g. the code before a change) in the
same run.

Each case runs on a fresh `rbee-worker serve` process; requests go through POST /v1/completions, streamed, prompts
as token ids, `ignore_eos` (every stream generates exactly --gen-tokens), greedy; with `--sampling greedy chat` the
decode cases run again at temperature 0.7, top_p 0.9 (results keyed `<case>@chat`). Cases:

- `batch1`: one stream after a 32-token prompt: decode tokens/s (first token to last) and its ratio to the ceiling
  (bytes/s the GPU reads over the weight bytes plus the KV bytes one step reads: a sliding layer's over its window;
  of a mixture of experts, the weights one token reads, its routed experts, as the worker's ready line reports them);
- `batch64`: 64 streams after 32-token prompts at once: aggregate tokens/s over the window where all 64 decode
  (its ceiling reads every weight, every expert);
- `long1`: one stream after an 8,000-token prompt (--long-prompt): decode tokens/s against its ceiling;
- `long64`: 64 streams after distinct 2,000-token prompts: aggregate decode tokens/s where all decode, against
  the ceiling of a step over 64 such contexts;
- `shared64`: 64 requests sharing a 2,000-token prefix (each its own 32-token tail) at once: mean time to first
  token, with the prefix cache and with --no-prefix-cache.
- `chat`: --chat-requests chat requests at once sharing a system prompt of --system-tokens tokens (greedy, short
  answers): all must complete; then --repeats requests with new questions, one at a time, timed to their first
  token (median), against the same requests on a worker with --no-prefix-cache, and their texts compared (how many
  are the same); /v1/models' max_model_len.

    PYTHONPATH=src python bench/kv_cache.py --model /tmp/m8b --device cuda --dtype bfloat16 --previous prev/src
    PYTHONPATH=src python bench/kv_cache.py --model demo --device cpu --cases chat --max-batch 32 --kv-cache-gb 1
"""

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from rbee_worker.benchmark.peers import SAMPLING
from rbee_worker.benchmark.run import TEXT, logged_weights, machine, read_bandwidth, start_worker, tokenizer_of

CASES = ("batch1", "batch64", "long1", "long64", "shared64", "chat")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--runtime", default="auto", help="the worker's --runtime (default: %(default)s)")
    parser.add_argument("--cases", nargs="+", default=list(CASES[:5]), choices=CASES)
    parser.add_argument("--previous", type=Path, help="a src/ directory of another build to measure alongside")
    parser.add_argument("--max-batch", type=int, default=64)
    parser.add_argument("--kv-cache-gb", type=float)
    parser.add_argument("--gen-tokens", type=int, default=128)
    parser.add_argument("--long-prompt", type=int, default=8000)
    parser.add_argument("--shared-prompt", type=int, default=2000)
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3, help="runs of each case on one worker (median)")
    parser.add_argument("--chat-requests", type=int, default=24)
    parser.add_argument("--system-tokens", type=int, default=1500)
    parser.add_argument(
        "--sampling",
        nargs="+",
        choices=sorted(SAMPLING),
        default=["greedy"],
        help="the decode cases' sampling, each on the same worker (chat: temperature 0.7, top_p 0.9)",
    )
    parser.add_argument("--worker-flag", action="append", default=[], help="a flag for the worker (repeatable)")
    parser.add_argument("--out", type=Path, default=Path(f"rbee-bench-{time.strftime('%Y%m%d-%H%M%S')}"))
    return parser.parse_args(argv)


async def stream(client: httpx.AsyncClient, prompt: list[int], tokens: int, sampling: dict) -> list[float]:
    """The arrival time of each token of one streamed completion (the request's start first)."""
    body = {"prompt": prompt, "max_tokens": tokens, "ignore_eos": True, "stream": True, **sampling}
    times = [time.perf_counter()]
    async with client.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                if chunk["choices"] and chunk["choices"][0].get("text") is not None:
                    times.append(time.perf_counter())
    return times


async def run_streams(url: str, prompts: list[list[int]], tokens: int, sampling: dict) -> list[list[float]]:
    limits = httpx.Limits(max_connections=len(prompts) + 4)
    async with httpx.AsyncClient(base_url=url, timeout=1800, limits=limits) as client:
        return await asyncio.gather(*(stream(client, p, tokens, sampling) for p in prompts))


def decode_rate(results: list[list[float]]) -> float:
    """Tokens/s over the window in which every stream decodes (after the last first token, before the first end)."""
    start = max(times[1] for times in results)
    end = min(times[-1] for times in results)
    if end <= start:
        return float("nan")
    count = sum(sum(1 for t in times[2:] if start < t <= end) for times in results)
    return count / (end - start)


def prompts(spec: dict, count: int, length: int, shared: int = 0) -> list[list[int]]:
    """`count` prompts of `length` tokens: the first `shared` tokens the same in all, the rest each its own (a
    distinct first token after the shared part)."""
    ids, distinct = spec["ids"], spec["distinct"]
    return [[*ids[:shared], distinct[i % len(distinct)], *ids[: length - shared - 1]] for i in range(count)]


def worker(args: argparse.Namespace, log: Path, src: Path | None, flags: list[str]) -> tuple[object, str]:
    """A fresh worker of this build, or of `src`."""
    worker_args = argparse.Namespace(
        model=args.model, device=args.device, dtype=args.dtype, concurrency=[args.max_batch], worker_flag=flags
    )
    previous = os.environ.get("PYTHONPATH")
    if src is not None:  # ahead of this build's src/ and whatever else the path holds
        os.environ["PYTHONPATH"] = os.pathsep.join([str(src.resolve()), *filter(None, [previous])])
    try:
        process, url, healthy = start_worker(worker_args, log)
    finally:
        if previous is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = previous
    print(f"worker {'of ' + str(src) if src else ''} healthy after {healthy:.1f} s", flush=True)
    return process, url


def measure(args: argparse.Namespace, spec: dict, src: Path | None, flags: list[str], work: Path) -> dict:
    """The decode cases on one worker (median of --repeats each)."""
    log = work / f"worker_{len(list(work.iterdir()))}.log"
    process, url = worker(args, log, src, flags)
    out: dict = {}
    try:
        for case in args.cases:
            if case in ("chat", "shared64"):
                continue
            for mode in args.sampling:
                key = case if mode == "greedy" else f"{case}@{mode}"
                out[key] = decode_case(url, case, spec, args, SAMPLING[mode])
        out |= logged_weights(log)
        out["max_model_len"] = httpx.get(f"{url}/v1/models", timeout=60).json()["data"][0].get("max_model_len")
        out["kv_cache_bytes"] = httpx.get(f"{url}/health", timeout=60).json().get("kv_cache_bytes")
    finally:
        process.terminate()
        process.wait(60)
    return out


def decode_case(url: str, case: str, spec: dict, args: argparse.Namespace, sampling: dict) -> dict:
    """One decode case's tokens/s, the median of --repeats runs after an untimed first run: it compiles nothing (the
    worker warmed up before ready) but fills the prefix cache, so that in the timed runs the streams' prompts take no
    prefill rounds and they all decode together."""
    runs = []
    for _ in range(args.repeats + 1):
        if case in ("batch1", "long1"):
            p = prompts(spec, 1, 32 if case == "batch1" else args.long_prompt)
            times = asyncio.run(run_streams(url, p, args.gen_tokens, sampling))[0]
            runs.append((len(times) - 2) / (times[-1] - times[1]))
        else:
            p = prompts(spec, args.streams, 32 if case == "batch64" else args.shared_prompt)
            runs.append(decode_rate(asyncio.run(run_streams(url, p, args.gen_tokens, sampling))))
    return {"tok_s": statistics.median(runs[1:]), "runs": runs[1:], "untimed_first": runs[0]}


def shared_ttft(args: argparse.Namespace, spec: dict, src: Path | None, flags: list[str], work: Path) -> dict:
    """Mean time to first token of --streams requests sharing a prefix, sent at once (median of --repeats rounds,
    each on its own prefix, so that no round finds an earlier one's blocks)."""
    log = work / f"worker_{len(list(work.iterdir()))}.log"
    process, url = worker(args, log, src, flags)
    rounds = []
    try:
        for round_ in range(args.repeats):
            base = prompts(spec, args.streams, args.shared_prompt + 32, shared=args.shared_prompt)
            shift = [spec["distinct"][-1 - round_]]
            batch = [shift + p[1:] for p in base]  # another first token: another prefix for each round
            results = asyncio.run(run_streams(url, batch, 8, SAMPLING["greedy"]))
            rounds.append(statistics.mean(times[1] - times[0] for times in results))
    finally:
        process.terminate()
        process.wait(60)
    return {"mean_ttft_s": statistics.median(rounds), "rounds": rounds}


def chat_body(system: str, question: str, model: str) -> dict:
    messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    return {"model": model, "messages": messages, "max_tokens": 24, "temperature": 0}


async def chat_burst(url: str, bodies: list[dict]) -> list[dict]:
    """Chat requests sent at once; their responses."""
    limits = httpx.Limits(max_connections=len(bodies) + 4)
    async with httpx.AsyncClient(base_url=url, timeout=1800, limits=limits) as client:
        responses = await asyncio.gather(*(client.post("/v1/chat/completions", json=b) for b in bodies))
        return [r.json() for r in responses]


def timed_chat(url: str, body: dict) -> dict:
    """One streamed chat request alone: its time to first token, text and usage."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    first, text, usage = None, [], {}
    with httpx.Client(base_url=url, timeout=1800) as client:
        started = time.perf_counter()
        with client.stream("POST", "/v1/chat/completions", json=body) as response:
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                usage = chunk.get("usage") or usage
                for choice in chunk.get("choices", []):
                    if choice["delta"].get("content"):
                        first = first or time.perf_counter()
                        text.append(choice["delta"]["content"])
    return {"ttft_s": (first or time.perf_counter()) - started, "text": "".join(text), "usage": usage}


def chat_case(args: argparse.Namespace, work: Path, flags: list[str]) -> dict:
    """--chat-requests chat requests sharing a system prompt at once on a worker with the prefix cache; then, on it and
    on one without the cache, --repeats requests with new questions, one at a time, timed: their system prompt is
    cached on the first."""
    tokenizer = spec_tokenizer(args)
    text = " ".join([TEXT] * (args.system_tokens // 60 + 1))
    system = tokenizer.decode(tokenizer(text, add_special_tokens=False)["input_ids"][: args.system_tokens])
    questions = [f"Question {i}: in one sentence, what is item {i} of the story about?" for i in range(64)]
    new_questions = questions[args.chat_requests : args.chat_requests + args.repeats]
    out: dict = {}
    for label, extra in (("cache", []), ("no_cache", ["--no-prefix-cache"])):
        process, url = worker(args, work / f"worker_chat_{label}.log", None, flags + extra)
        try:
            models = httpx.get(f"{url}/v1/models", timeout=60).json()["data"][0]
            out[label] = {"max_model_len": models.get("max_model_len")}
            if label == "cache":
                bodies = [chat_body(system, q, models["id"]) for q in questions[: args.chat_requests]]
                started = time.perf_counter()
                answers = asyncio.run(chat_burst(url, bodies))
                out[label]["burst_s"] = time.perf_counter() - started
                out[label]["completed"] = sum(1 for a in answers if a.get("choices"))
                out[label]["requests"] = args.chat_requests
            timed = [timed_chat(url, chat_body(system, q, models["id"])) for q in new_questions]
            out[label] |= {
                "prompt_tokens": [t["usage"].get("prompt_tokens") for t in timed],
                "cached_tokens": [(t["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") for t in timed],
                "ttft_s": statistics.median(t["ttft_s"] for t in timed),
                "ttfts_s": [t["ttft_s"] for t in timed],
                "texts": [t["text"] for t in timed],
            }
        finally:
            process.terminate()
            process.wait(60)
    out["ttft_ratio"] = out["cache"]["ttft_s"] / out["no_cache"]["ttft_s"]
    out["same_text"] = out["cache"]["texts"] == out["no_cache"]["texts"]
    out["same_texts"] = sum(a == b for a, b in zip(out["cache"]["texts"], out["no_cache"]["texts"], strict=True))
    return out


def spec_tokenizer(args: argparse.Namespace) -> object:
    from rbee_worker.loading.loader import resolve_model_path

    return tokenizer_of(resolve_model_path(args.model))


def kv_bytes_read(config: object, tokens: int) -> int:
    """Bytes of keys and values (bfloat16) a decode step reads for one row of `tokens` context: every layer's, a
    sliding layer's only over its window."""
    import torch

    from rbee_worker.engine.runners.torch.kv_cache import kv_shape, sliding_layers

    heads, key_dim, value_dim = kv_shape(config)
    window, sliding = sliding_layers(config)
    layers = config.get_text_config().num_hidden_layers
    read = (layers - len(sliding)) * tokens + len(sliding) * min(tokens, window or tokens)
    return read * heads * (key_dim + value_dim) * torch.bfloat16.itemsize


def ceilings(args: argparse.Namespace, result: dict, weights: dict[str, int], config: object) -> None:
    """Each case's decode ceiling: the rows a step serves times the bandwidth over the bytes the step reads. One row
    reads the weights a token reads (a mixture of experts' routed experts), many rows all of them (every expert)."""
    bandwidth = result["machine"]["read_bandwidth_gb_s"] * 1e9
    contexts = {"batch1": (1, 32 + args.gen_tokens // 2), "long1": (1, args.long_prompt + args.gen_tokens // 2),
                "batch64": (args.streams, 32 + args.gen_tokens // 2),
                "long64": (args.streams, args.shared_prompt + args.gen_tokens // 2)}  # fmt: skip
    result["ceiling_tok_s"] = {
        case: rows
        * bandwidth
        / (weights["active_weight_bytes" if rows == 1 else "weight_bytes"] + rows * kv_bytes_read(config, tokens))
        for case, (rows, tokens) in contexts.items()
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    flags = ["--runtime", args.runtime, *(["--kv-cache-gb", str(args.kv_cache_gb)] if args.kv_cache_gb else [])]
    flags += args.worker_flag
    tokenizer = spec_tokenizer(args)
    ids = tokenizer(TEXT * (max(args.long_prompt, args.shared_prompt) // 40 + 2), add_special_tokens=False)
    ids = ids["input_ids"]
    spec = {"ids": ids, "distinct": list(range(1000, 1000 + max(args.streams, 64)))}
    result: dict = {"machine": machine(), "args": {k: str(v) for k, v in vars(args).items()}}
    if args.device.startswith("cuda"):
        result["machine"]["read_bandwidth_gb_s"] = read_bandwidth(args.device) / 1e9
    builds = [("this", None)] + ([("previous", args.previous)] if args.previous else [])
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        save = args.out / "kv_cache.json"
        for name, src in builds:
            if any(c not in ("chat", "shared64") for c in args.cases):
                result[name] = measure(args, spec, src, flags, work)
                print(name, json.dumps(result[name]), flush=True)
                save.write_text(json.dumps(result, indent=2))
        if "shared64" in args.cases:
            result["shared64"] = {
                "cache": shared_ttft(args, spec, None, flags, work),
                "no_cache": shared_ttft(args, spec, None, [*flags, "--no-prefix-cache"], work),
            }
            shared = result["shared64"]
            shared["ratio"] = shared["cache"]["mean_ttft_s"] / shared["no_cache"]["mean_ttft_s"]
            print("shared64", json.dumps(shared), flush=True)
            save.write_text(json.dumps(result, indent=2))
        if "chat" in args.cases:
            result["chat"] = chat_case(args, work, flags)
            print("chat", json.dumps(result["chat"]), flush=True)
        for log in work.glob("*.log"):
            with contextlib.suppress(OSError):
                (args.out / log.name).write_text(log.read_text(errors="replace")[-20000:])
    if "read_bandwidth_gb_s" in result["machine"] and result.get("this", {}).get("weight_bytes"):
        from transformers import AutoConfig

        from rbee_worker.loading.loader import resolve_model_path

        config = AutoConfig.from_pretrained(resolve_model_path(args.model))
        ceilings(args, result, result["this"], config)
        if result["this"].get("kv_cache_bytes"):  # the context that the same bytes give a model without windows
            per_token = kv_bytes_read(config, 1)  # every layer's keys and values of one token (bfloat16)
            result["this"]["context_without_windows"] = min(
                config.get_text_config().max_position_embeddings, result["this"]["kv_cache_bytes"] // per_token
            )
    print_table(result)
    (args.out / "kv_cache.json").write_text(json.dumps(result, indent=2))
    return 0


def print_table(result: dict) -> None:
    ceiling = result.get("ceiling_tok_s", {})
    print("| case | this tok/s | x ceiling | previous tok/s | this / previous |")
    print("|---|---|---|---|---|")
    for key, measured in result.get("this", {}).items():
        this = measured.get("tok_s") if isinstance(measured, dict) else None
        if this is None:
            continue
        case = key.split("@")[0]
        prev = result.get("previous", {}).get(key, {}).get("tok_s")
        cells = [key, f"{this:.1f}", f"{this / ceiling[case]:.2f}" if case in ceiling else ""]
        cells += [f"{prev:.1f}" if prev else "", f"{this / prev:.3f}" if prev else ""]
        print("| " + " | ".join(cells) + " |")
    if this := result.get("this"):
        offered, pool, plain = (this.get(k) for k in ("max_model_len", "kv_cache_bytes", "context_without_windows"))
        print(f"context offered (/v1/models): {offered} tokens; KV cache {pool} bytes, which every layer's keys and "
              f"values would fill at {plain} tokens")  # fmt: skip
    if shared := result.get("shared64"):
        print(f"shared prefix: mean TTFT {shared['cache']['mean_ttft_s']:.3f} s with the cache, "
              f"{shared['no_cache']['mean_ttft_s']:.3f} s without: {shared['ratio']:.3f}x")  # fmt: skip
    if chat := result.get("chat"):
        print(f"chat: {chat['cache']['completed']}/{chat['cache']['requests']} completed, max_model_len "
              f"{chat['cache']['max_model_len']}, cached {chat['cache']['cached_tokens']} of "
              f"{chat['cache']['prompt_tokens']} prompt tokens, TTFT {chat['cache']['ttft_s']:.3f} s vs "
              f"{chat['no_cache']['ttft_s']:.3f} s without the cache: {chat['ttft_ratio']:.3f}x, same text: "
              f"{chat['same_texts']} of {len(chat['cache']['texts'])}")  # fmt: skip


if __name__ == "__main__":
    raise SystemExit(main())
