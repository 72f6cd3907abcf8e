"""`rbee-worker bench`: rbee-worker measured through its real HTTP API, and the peers in the same run.

The worker runs as its own `serve` process on 127.0.0.1; every request goes through POST /v1/completions (streamed,
with --sampling's temperature and top_p, prompt given as token ids, `ignore_eos` so each stream generates exactly
--gen-tokens). Figures:

- time to first token for a --prompt-tokens prompt (and prefill tokens/s from it), one request at a time;
- single-stream decode tokens/s: (tokens - 1) / (last token time - first token time);
- aggregate tokens/s at each --concurrency: all generated tokens / (last end - first start).

Each is the median of --repeats runs. Peers (peers.py) run one per fresh process on the same weights, dtype and
prompt ids. The llama.cpp peer's several streams (its bare batched `llama_decode` loop) run between the worker's own
runs, each right after the worker's run at the same concurrency, while the worker idles: on a machine whose speed
drifts within a minute (a shared VM), a pair measured seconds apart sees the same machine, so each ratio to the bare
loop is the median of its pairs' ratios. With --rounds N the worker and every peer are measured in turn N times
(worker, peers, worker, ...), so a machine whose speed drifts weighs on all of them alike: each figure is then the
median over the rounds, and each ratio the median of the rounds' own ratios. Results go to
bench_<model>_..._<machine>.json and .md, with the machine and card named, in --out: by default a new directory
rbee-bench-<date>-<time> in the current directory, so that a run never overwrites the results recorded in
bench/results (written there only when asked).
"""

import argparse
import asyncio
import atexit
import contextlib
import gc
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

from rbee_worker.benchmark.peers import BARE_LOOP, CONCURRENCY, SAMPLING, WORKER_PEERS

TEXT = (
    "The history of the river town begins with the old stone bridge, built by farmers who needed a way to bring "
    "their grain to the market on the other bank. Over the centuries the town grew around the bridge: mills, "
    "workshops, a church, a school, and later a railway station that connected it to the capital. "
)


@dataclass
class Stream:
    started: float
    first: float
    ended: float
    tokens: int


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine() -> dict:
    import torch

    info = {"cpu": cpu_name(), "cores": os.cpu_count(), "torch": torch.__version__}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


async def stream_completion(url: str, prompt: list[int], tokens: int, sampling: dict) -> Stream:
    """One streamed completion on a connection of its own, read with asyncio's streams: HTTP/1.1, the chunked body
    cut into SSE lines here. The client shares the host's cores with the model, so what it costs per chunk weighs on
    the worker's figures; a client library's stream reading costs several times this (bench/results/README.md)."""
    address = urlsplit(url)
    body = json.dumps(
        {
            "prompt": prompt,
            "max_tokens": tokens,
            **sampling,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    ).encode()
    started = time.perf_counter()
    first = ended = 0.0
    count = 0
    reader, writer = await asyncio.open_connection(address.hostname, address.port)
    try:
        writer.write(
            b"POST /v1/completions HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (address.netloc.encode(), len(body), body)
        )
        status = await reader.readline()
        headers = (await reader.readuntil(b"\r\n\r\n")).lower()
        if b" 200 " not in status or b"transfer-encoding: chunked" not in headers:
            raise RuntimeError(f"the worker answered {status.decode().strip()}: {(await reader.read()).decode()}")
        pending = b""
        while size := int((await reader.readline()).split(b";")[0], 16):
            *lines, pending = (pending + (await reader.readexactly(size + 2))[:-2]).split(b"\n")
            for line in lines:
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    count = chunk["usage"]["completion_tokens"]
                elif chunk["choices"] and chunk["choices"][0]["text"]:
                    ended = time.perf_counter()
                    first = first or ended
    finally:
        writer.close()
    return Stream(started, first, ended, count)


async def measure_worker(url: str, spec: dict, between: Callable[[int], object] | None = None) -> dict:
    """The worker's figures (see the module docstring); `between(concurrency)` is called after each of its runs of
    several streams, while it idles (the bare loop of the pair)."""
    repeats, gen = spec["repeats"], spec["gen_tokens"]

    def complete(prompt: list[int], tokens: int) -> Awaitable[Stream]:
        return stream_completion(url, prompt, tokens, spec["sampling"])

    await complete(spec["short_prompt"], gen)  # warm-up, as long as a measured run
    await complete(spec["long_prompt"], 2)
    ttft = []
    for _ in range(repeats):
        s = await complete(spec["long_prompt"], 2)
        ttft.append(s.first - s.started)
    decode = []
    for _ in range(repeats):
        s = await complete(spec["short_prompt"], gen)
        decode.append((s.tokens - 1) / (s.ended - s.first))
    aggregate: dict[str, float] = {}
    runs: dict[str, list[float]] = {"ttft_s": ttft, "decode_tok_s": decode}
    for concurrency in spec["concurrency"]:
        rates = runs[f"aggregate_tok_s@{concurrency}"] = []
        for _ in range(repeats):
            prompts = [spec["short_prompt"] + [i] for i in spec["distinct_ids"][:concurrency]]
            streams = await asyncio.gather(*(complete(p, gen) for p in prompts))
            wall = max(s.ended for s in streams) - min(s.started for s in streams)
            rates.append(sum(s.tokens for s in streams) / wall)
            if between is not None:
                between(concurrency)
        aggregate[str(concurrency)] = statistics.median(rates)
    return {
        "ttft_s": statistics.median(ttft),
        "prefill_tok_s": len(spec["long_prompt"]) / statistics.median(ttft),
        "decode_tok_s": statistics.median(decode),
        "aggregate_tok_s": aggregate,
        "runs": runs,
    }


def start_worker(args: argparse.Namespace, log_path: Path) -> tuple[subprocess.Popen, str, float]:
    """The served worker, its URL, and the seconds it took to report healthy (loading, compiling, capturing); its
    log (JSON lines) goes to log_path. This process's heap is frozen once the worker is up, as the worker freezes its
    own (engine.freeze_heap): what the measuring client has imported is never walked by the garbage collector again,
    whose full collections would otherwise land in the timings."""
    from rbee_worker.server.listener import bind

    sock = bind("127.0.0.1", 0)
    port = sock.getsockname()[1]
    sock.close()
    command = [
        sys.executable, "-m", "rbee_worker", "serve", "--model", args.model, "--port", str(port),
        "--device", args.device, "--dtype", args.dtype, "--max-batch", str(max(args.concurrency)),
        "--log-level", "info", "--log-format", "json", *args.worker_flag,
    ]  # fmt: skip
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=log_path.open("wb"))
    url = f"http://127.0.0.1:{port}"
    started = time.monotonic()
    deadline = started + 600
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"error: the worker exited with {process.returncode}: {log_path.read_text()[-2000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                healthy = time.monotonic() - started
                gc.collect()
                gc.freeze()
                # Given back at exit, so that the interpreter's finalization frees it (see Engine.close).
                atexit.register(gc.unfreeze)
                return process, url, healthy
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    process.kill()
    raise SystemExit("error: the worker did not become healthy within 600 s")


def logged_weights(log_path: Path) -> dict[str, int]:
    """The weight bytes the worker reports in its ready line, all of them and those one token reads (a mixture of
    experts' routed experts; a build that does not log them: all), whatever their format (bf16, int8, int4): the
    batch-1 ceiling reads the active ones. Empty where the worker never got ready."""
    for line in log_path.read_text(errors="replace").splitlines():
        with contextlib.suppress(ValueError, AttributeError):
            if (fields := json.loads(line)).get("msg", "").startswith("ready:") and "weight_bytes" in fields:
                total = int(fields["weight_bytes"])
                return {"weight_bytes": total, "active_weight_bytes": int(fields.get("active_weight_bytes", total))}
    return {}


def run_peer(peer: str, args: argparse.Namespace, spec: dict) -> dict:
    command = [
        sys.executable, "-m", "rbee_worker.benchmark.peers", peer, "--model", args.model_path,
        "--device", args.device, "--dtype", args.dtype, "--spec", json.dumps(spec),
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        tail = result.stderr.strip().splitlines()[-1:] or ["no output"]
        return {"error": tail[0][:300]}
    return json.loads(result.stdout.strip().splitlines()[-1])


def build_spec(args: argparse.Namespace) -> dict:
    from rbee_worker.loading.loader import resolve_model_path

    args.model_path = str(resolve_model_path(args.model))
    tokenizer = tokenizer_of(Path(args.model_path))
    ids = tokenizer(TEXT * (args.prompt_tokens // 40 + 2), add_special_tokens=False)["input_ids"]
    return {
        "long_prompt": ids[: args.prompt_tokens],
        "short_prompt": ids[:16],
        # One different last token per concurrent stream, so no two streams are the same request.
        "distinct_ids": ids[16 : 16 + max(args.concurrency)],
        "gen_tokens": args.gen_tokens,
        "sampling": SAMPLING[args.sampling],
        "repeats": args.repeats,
        "concurrency": args.concurrency,
        "threads": args.threads,
    }


def tokenizer_of(model: Path) -> Any:  # a transformers tokenizer
    from rbee_worker.loading.gguf.gguf_format import read_gguf
    from rbee_worker.loading.gguf.gguf_tokenizer import build_tokenizer
    from rbee_worker.loading.hf import load_tokenizer

    return load_tokenizer(model) if model.is_dir() else build_tokenizer(read_gguf(model).metadata)


def markdown(result: dict) -> str:
    rows = [("rbee-worker", result["rbee-worker"])] + [(p, r) for p, r in result["peers"].items()]
    concurrency = [str(c) for c in result["spec"]["concurrency"]]
    head = ["system", "TTFT s", "prefill tok/s", "decode tok/s", *(f"agg@{c}" for c in concurrency)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, r in rows:
        if "error" in r:
            lines.append(f"| {name} | error: {r['error']} |")
            continue
        ttft = r.get("ttft_s")
        cells = [
            name,
            f"{ttft:.3f}" if ttft else "",
            f"{result['spec']['prompt_tokens'] / ttft:.0f}" if ttft else "",
            f"{r['decode_tok_s']:.1f}" if "decode_tok_s" in r else "",
            *(f"{r.get('aggregate_tok_s', {}).get(c, 0):.0f}" if r.get("aggregate_tok_s") else "" for c in concurrency),
        ]
        lines.append("| " + " | ".join(cells) + " |")
        if "plain_decode_tok_s" in r:
            lines.append(f"| {name}, plain buffers | | | {r['plain_decode_tok_s']:.1f} |")
        if decode_only := r.get("decode_aggregate_tok_s"):
            lines.append(
                f"| {name}, decode steps alone | | | | "
                + " | ".join(f"{decode_only[c]:.0f}" for c in concurrency)
                + " |"
            )
    return "\n".join(lines)


def read_bandwidth(device: str) -> float:
    """Bytes/s the GPU reads, from summing a 4 GiB tensor (median of 5): the batch-1 decode ceiling is this divided
    by the weight bytes."""
    import torch

    data = torch.ones(2**30, dtype=torch.float32, device=device)
    times = []
    for _ in range(6):
        torch.cuda.synchronize(device)
        started = time.perf_counter()
        data.sum()
        torch.cuda.synchronize(device)
        times.append(time.perf_counter() - started)
    del data
    torch.cuda.empty_cache()
    return 2**32 / statistics.median(times[1:])


def serve_and_measure(
    args: argparse.Namespace, spec: dict, flags: list[str], between: Callable[[int], object] | None = None
) -> dict:
    """A `serve` process with --worker-flag's flags and `flags`, measured through its HTTP API (`between`: see
    measure_worker), then stopped."""
    with tempfile.TemporaryDirectory() as scratch:
        log_path = Path(scratch) / "worker.log"
        process, url, startup_s = start_worker(
            argparse.Namespace(**{**vars(args), "worker_flag": [*args.worker_flag, *flags]}), log_path
        )
        try:
            figures = asyncio.run(measure_worker(url, spec, between)) | {"startup_s": startup_s}
        finally:
            process.terminate()
            process.wait(timeout=60)
        return figures | logged_weights(log_path)


def measure_round(args: argparse.Namespace, spec: dict) -> dict:
    """The worker, then each peer, once: {"rbee-worker": figures, "peers": {peer: figures}}. The llama.cpp peer's
    several streams run between the worker's runs (the module docstring), its batch-1 figures after the worker."""
    bare: list[dict] = []

    def bare_loop(concurrency: int) -> None:
        bare.append(run_peer(BARE_LOOP, args, spec | {"concurrency": [concurrency], "repeats": 1}))

    paired = "llama.cpp" in args.peers and spec["concurrency"]
    worker = serve_and_measure(args, spec, [], bare_loop if paired else None)
    peers = {}
    for peer in args.peers:
        if peer in WORKER_PEERS:
            peers[peer] = serve_and_measure(args, spec, WORKER_PEERS[peer])
        elif peer == "llama.cpp" and paired:
            peers[peer] = paired_figures(run_peer(peer, args, spec | {"concurrency": []}), bare)
        else:
            peers[peer] = run_peer(peer, args, spec)
    return {"rbee-worker": worker, "peers": peers}


def paired_figures(figures: dict, bare: list[dict]) -> dict:
    """The llama.cpp peer's batch-1 figures with its bare loop's runs (one a call, in the order run) joined in as if
    measured by one process, and `paired` set; the first error, if any."""
    if failed := next((f for f in [figures, *bare] if "error" in f), None):
        return failed
    figures = figures | {"paired": True, "runs": dict(figures.get("runs", {}))}
    for run in bare:
        for figure in ("aggregate_tok_s", "decode_aggregate_tok_s"):
            for concurrency, value in run[figure].items():
                figures["runs"].setdefault(f"{figure}@{concurrency}", []).append(value)
    for figure in ("aggregate_tok_s", "decode_aggregate_tok_s"):
        figures[figure] = {
            key.split("@")[1]: statistics.median(values)
            for key, values in figures["runs"].items()
            if key.startswith(f"{figure}@")
        }
    return figures


def ratios(worker: dict, peers: dict) -> dict[str, float]:
    """The worker's figures over the peers': decode tok/s, and aggregate tok/s at each concurrency both measured; for
    a peer whose runs were `paired` with the worker's (run right after each), the median of the pairs' ratios."""
    out = {}
    for peer, figures in peers.items():
        if "decode_tok_s" in figures:
            out[f"decode_ratio_vs_{peer}"] = worker["decode_tok_s"] / figures["decode_tok_s"]
        if "plain_decode_tok_s" in figures:
            out[f"decode_ratio_vs_{peer}_plain_buffers"] = worker["decode_tok_s"] / figures["plain_decode_tok_s"]
        for concurrency, tok_s in figures.get("aggregate_tok_s", {}).items():
            if concurrency not in worker.get("aggregate_tok_s", {}):
                continue
            key = f"aggregate_tok_s@{concurrency}"
            if figures.get("paired"):
                pairs = zip(worker["runs"][key], figures["runs"][key], strict=True)
                out[f"aggregate_ratio_vs_{peer}@{concurrency}"] = statistics.median(w / p for w, p in pairs)
            else:
                out[f"aggregate_ratio_vs_{peer}@{concurrency}"] = worker["aggregate_tok_s"][concurrency] / tok_s
    return out


def combine(rounds: list[Any]) -> Any:
    """One system's figures over the rounds: numbers by their median, lists of runs joined, dicts key by key, anything
    else (flags, names) from the first round; a round that failed makes the whole an error."""
    first = rounds[0]
    if isinstance(first, dict):
        if failed := next((r for r in rounds if "error" in r), None):
            return failed
        return {key: combine([r[key] for r in rounds if key in r]) for key in first}
    if isinstance(first, list):
        return [item for r in rounds for item in r]
    if isinstance(first, (int, float)) and not isinstance(first, bool):
        return statistics.median(rounds)
    return first


def main(args: argparse.Namespace) -> int:
    spec = build_spec(args)
    result: dict = {
        "machine": machine(), "model": args.model, "device": args.device, "dtype": args.dtype,
        "worker_flags": args.worker_flag, "sampling": args.sampling, "rounds": args.rounds,
    }  # fmt: skip
    if args.device.startswith("cuda"):
        result["read_bandwidth_gb_s"] = read_bandwidth(args.device) / 1e9
    rounds = [measure_round(args, spec) for _ in range(args.rounds)]
    result["rbee-worker"] = worker = combine([r["rbee-worker"] for r in rounds])
    result["peers"] = peers = {peer: combine([r["peers"][peer] for r in rounds]) for peer in args.peers}
    if "bare_forward_s" in peers.get("transformers", {}):
        result["ttft_over_bare_forward"] = worker["ttft_s"] / peers["transformers"]["bare_forward_s"]
    if "read_bandwidth_gb_s" in result and worker.get("active_weight_bytes"):
        ceiling = result["read_bandwidth_gb_s"] * 1e9 / worker["active_weight_bytes"]
        result["batch1_ceiling_tok_s"] = ceiling
        result["decode_ratio_vs_ceiling"] = worker["decode_tok_s"] / ceiling
    round_ratios = [ratios(r["rbee-worker"], r["peers"]) for r in rounds if "error" not in r["rbee-worker"]]
    result |= combine(round_ratios) if round_ratios else {}
    if args.rounds > 1:
        result["round_ratios"] = round_ratios
        result["round_figures"] = rounds
    result["spec"] = {k: v for k, v in spec.items() if not k.endswith(("prompt", "ids"))}
    result["spec"]["prompt_tokens"] = len(spec["long_prompt"])
    table = markdown(result)
    print(table)
    for key, value in result.items():
        if ("ratio" in key or key.endswith("bare_forward")) and isinstance(value, float):
            print(f"{key}: {value:.2f}")
    print(f"rbee-worker start-up (to healthy): {worker['startup_s']:.1f} s")
    # "Intel(R) Xeon(R) Processor" -> "Intel_Xeon_Processor": a file name without shell-special characters
    machine_name = result["machine"].get("gpu") or result["machine"]["cpu"]
    name = "_".join(re.sub(r"\(R\)|\(TM\)|[^\w.-]", " ", machine_name).split())
    out = args.out or Path(f"rbee-bench-{time.strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    flags = "".join(f"_{flag.lstrip('-').replace('=', '_')}" for flag in args.worker_flag)
    streams = "" if args.concurrency == CONCURRENCY else "_c" + "-".join(map(str, args.concurrency))
    sampling = "" if args.sampling == "greedy" else f"_{args.sampling}"
    rounds = f"_r{args.rounds}" if args.rounds > 1 else ""
    run = f"{flags}{streams}{sampling}{rounds}"
    stem = f"bench_{Path(args.model).stem}_{args.device.replace(':', '')}_{args.dtype}{run}_{name}"
    (out / f"{stem}.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / f"{stem}.md").write_text(f"{json.dumps(result['machine'])}\n\n{table}\n")
    print(f"results: {out / stem}.json and .md")
    return 0
