"""A worker's first requests of each sampling mode against its later ones: what a just-started worker pays at first use.

One fresh `rbee-worker serve` process (start-up to healthy timed: launch to /health 200), then, for each mode in turn
(sampling_ratio.py's modes), --rounds rounds of one stream, then --rounds rounds of --concurrency streams, with no
untimed pass before them: each mode's first one-stream request and first many-stream round are measured cold. Every
request goes through /v1/completions, streamed, `ignore_eos` (exactly --gen-tokens tokens each) after a
--prompt-tokens prompt of token ids (short: prefill is not what is timed; one distinct last token per stream). Each
round opens its own HTTP client, so every round pays the same connection set-up.

Per mode and stream count: the cold ratio, the first round's wall time over the last's (the fifth with the default
--rounds 5; wanted <= 1.1), and the steady aggregate tokens/s, the median of rounds 2..N, with its ratio to greedy's.

    PYTHONPATH=src python bench/cold_start.py --model demo --device cpu --concurrency 4 --gen-tokens 32
    PYTHONPATH=src python bench/cold_start.py --model /tmp/m8b --device cuda --dtype bfloat16
"""

import argparse
import asyncio
import contextlib
import json
import re
import statistics
import tempfile
import time
from pathlib import Path

from rbee_worker.benchmark.peers import SAMPLING_MODES
from rbee_worker.benchmark.run import build_spec, machine, start_worker, stream_completion

MODES = SAMPLING_MODES
COLD_RATIO_MAX = 1.1  # the first round's time over the last's, wanted at most this
LOGPROBS_MIN = 0.85  # chat+logprobs5's steady aggregate over greedy's at --concurrency, wanted at least this
# Start-up lines of the worker's log kept in the JSON (messages starting so); every warning and error is kept too.
STARTUP_MESSAGES = ("KV cache:", "prepared the", "ready:", "loaded", "loading", "torch.compile")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--concurrency", type=int, default=64, help="streams of the many-stream rounds")
    parser.add_argument("--gen-tokens", type=int, default=256)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5, help="rounds per mode and stream count (at least 2)")
    parser.add_argument(
        "--modes", default=",".join(MODES), help="comma-separated, in the order run: " + ",".join(MODES)
    )
    parser.add_argument("--worker-flag", action="append", default=[], help="passed to `rbee-worker serve` (repeat)")
    parser.add_argument("--out", type=Path, default=Path("bench/results/cold_start"))
    args = parser.parse_args(argv)
    if args.rounds < 2:
        parser.error("--rounds must be at least 2 (the first against the last)")
    if args.concurrency < 1 or args.gen_tokens < 2 or args.prompt_tokens < 1:
        parser.error("--concurrency and --prompt-tokens must be at least 1, --gen-tokens at least 2")
    args.modes = args.modes.split(",")
    if unknown := [m for m in args.modes if m not in MODES]:
        parser.error(f"unknown mode(s) {', '.join(unknown)}; known: {', '.join(MODES)}")
    return args


def stream_counts(args: argparse.Namespace) -> list[int]:
    return sorted({1, args.concurrency})


async def timed_round(url: str, prompts: list[list[int]], tokens: int, sampling: dict) -> dict:
    """All `prompts` streamed at once, a connection each: the round's wall time (first start to last token),
    aggregate tokens/s over it, and per stream the time to first token and decode tokens/s (medians)."""
    streams = await asyncio.gather(*(stream_completion(url, p, tokens, sampling) for p in prompts))
    wall = max(s.ended for s in streams) - min(s.started for s in streams)
    generated = sum(s.tokens for s in streams)
    return {
        "wall_s": wall,
        "aggregate_tok_s": generated / wall,
        "ttft_s": statistics.median(s.first - s.started for s in streams),
        "decode_tok_s": statistics.median((s.tokens - 1) / (s.ended - s.first) for s in streams),
        "tokens": generated,
    }


def summarize(rounds: list[dict]) -> dict:
    """One mode at one stream count: the cold ratios and the steady figures (medians of rounds 2..N)."""
    steady = rounds[1:]
    return {
        "cold_ratio": rounds[0]["wall_s"] / rounds[-1]["wall_s"],
        "cold_ratio_vs_median": rounds[0]["wall_s"] / statistics.median(r["wall_s"] for r in steady),
        "first_s": rounds[0]["wall_s"],
        "last_s": rounds[-1]["wall_s"],
        "first_ttft_s": rounds[0]["ttft_s"],
        "steady_ttft_s": statistics.median(r["ttft_s"] for r in steady),
        "steady_aggregate_tok_s": statistics.median(r["aggregate_tok_s"] for r in steady),
        "steady_decode_tok_s": statistics.median(r["decode_tok_s"] for r in steady),
        "rounds": rounds,
    }


def table(result: dict) -> str:
    """The markdown table: a row per mode and stream count, ratios to greedy where greedy was run."""
    rounds = result["spec"]["rounds"]
    head = ["mode", "streams", "round 1 s", f"round {rounds} s", f"cold ratio (<= {COLD_RATIO_MAX})",
            "1 / median 2..N", "1st TTFT s", "TTFT s", "steady agg tok/s", "steady decode tok/s",
            "x greedy"]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    greedy = result["modes"].get("greedy", {})
    for mode, by_streams in result["modes"].items():
        for streams, f in by_streams.items():
            base = greedy.get(streams)
            ratio = f"{f['steady_aggregate_tok_s'] / base['steady_aggregate_tok_s']:.3f}" if base else ""
            cold = f"{f['cold_ratio']:.2f}" + ("" if f["cold_ratio"] <= COLD_RATIO_MAX else " !")
            cells = [mode, streams, f"{f['first_s']:.3f}", f"{f['last_s']:.3f}", cold,
                     f"{f['cold_ratio_vs_median']:.2f}", f"{f['first_ttft_s']:.3f}",
                     f"{f['steady_ttft_s']:.3f}", f"{f['steady_aggregate_tok_s']:.1f}",
                     f"{f['steady_decode_tok_s']:.1f}", ratio]  # fmt: skip
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def checks(result: dict, concurrency: int) -> dict:
    """The issue's must-show: every cold ratio <= COLD_RATIO_MAX; chat+logprobs5 at `concurrency` streams >=
    LOGPROBS_MIN x greedy (None where a mode it needs was not run)."""
    modes = result["modes"]
    out: dict = {
        "cold_ratios_ok": all(f["cold_ratio"] <= COLD_RATIO_MAX for m in modes.values() for f in m.values()),
        "worst_cold_ratio": max((f["cold_ratio"], f"{mode}@{s}") for mode, m in modes.items() for s, f in m.items()),
    }
    c = str(concurrency)
    if "greedy" in modes and "chat+logprobs5" in modes:
        ratio = modes["chat+logprobs5"][c]["steady_aggregate_tok_s"] / modes["greedy"][c]["steady_aggregate_tok_s"]
        out |= {f"logprobs5_over_greedy@{c}": ratio, "logprobs_ok": ratio >= LOGPROBS_MIN}
    return out


def worker_log(log_path: Path) -> list[dict]:
    """The worker's JSON log lines, unreadable ones skipped."""
    lines = []
    for text in log_path.read_text(errors="replace").splitlines():
        with contextlib.suppress(ValueError):
            if isinstance(line := json.loads(text), dict):
                lines.append(line)
    return lines


def notable(lines: list[dict]) -> list[dict]:
    """Start-up lines (STARTUP_MESSAGES) and every warning or error, without the per-request lines."""
    keep = []
    for line in lines:
        message = str(line.get("msg", ""))
        if message.startswith(STARTUP_MESSAGES) or line.get("level") in ("warning", "error", "critical"):
            keep.append({k: v for k, v in line.items() if k != "logger"})
    return keep[:100]


def prepared_seconds(lines: list[dict]) -> dict | None:
    """From the runner's "prepared the <kind> forward in X s (N CUDA graphs)" line: X and N."""
    for line in lines:
        if match := re.match(r"prepared the (\w+) forward in ([\d.]+) s \((\d+) CUDA graphs\)", str(line.get("msg"))):
            return {"forward": match[1], "seconds": float(match[2]), "cuda_graphs": int(match[3])}
    return None


def main() -> None:
    args = parse_args()
    counts = stream_counts(args)
    # run.py's helpers read these: --max-batch is the largest stream count; the prompts come from the spec's text,
    # made long enough for the prompt and a distinct last token per stream.
    helper = {"concurrency": counts, "sampling": "greedy", "repeats": 1, "threads": None}
    helper["prompt_tokens"] = args.prompt_tokens + args.concurrency + 16
    helper_args = argparse.Namespace(**vars(args) | helper)
    spec = build_spec(helper_args)
    prompt = spec["long_prompt"][: args.prompt_tokens - 1]
    prompts = [[*prompt, i] for i in spec["distinct_ids"][: args.concurrency]]
    if len(prompts) < args.concurrency:
        raise SystemExit(f"error: only {len(prompts)} distinct prompts for {args.concurrency} streams")
    result: dict = {
        "model": args.model, "device": args.device, "dtype": args.dtype, "worker_flags": args.worker_flag,
        "spec": {"gen_tokens": args.gen_tokens, "prompt_tokens": len(prompts[0]), "rounds": args.rounds,
                 "concurrency": args.concurrency, "order": "each mode: rounds at 1 stream, then at --concurrency"},
        "modes": {},
    }  # fmt: skip
    with tempfile.TemporaryDirectory() as scratch:
        log_path = Path(scratch) / "worker.log"
        launched = time.monotonic()
        process, url, startup_s = start_worker(helper_args, log_path)
        result["startup_s"] = startup_s
        print(f"worker healthy after {startup_s:.1f} s ({url})", flush=True)
        at_ready = len(worker_log(log_path))
        try:
            for mode in args.modes:
                sampling = MODES[mode]
                result["modes"][mode] = {}
                for streams in counts:
                    rounds = []
                    for i in range(args.rounds):
                        rounds.append(asyncio.run(timed_round(url, prompts[:streams], args.gen_tokens, sampling)))
                        r = rounds[-1]
                        if r["tokens"] != streams * args.gen_tokens:
                            raise SystemExit(f"error: {mode} round {i + 1} at {streams} streams generated "
                                             f"{r['tokens']} tokens, not {streams * args.gen_tokens}")  # fmt: skip
                    figures = result["modes"][mode][str(streams)] = summarize(rounds)
                    walls = " ".join(f"{r['wall_s']:.3f}" for r in rounds)
                    print(f"{mode} @{streams}: rounds {walls} s, cold ratio {figures['cold_ratio']:.2f}, "
                          f"steady {figures['steady_aggregate_tok_s']:.1f} tok/s", flush=True)  # fmt: skip
        finally:
            process.terminate()
            process.wait(timeout=60)
        result["bench_s"] = time.monotonic() - launched
        lines = worker_log(log_path)
    result["prepared"] = prepared_seconds(lines)
    result["worker_log"] = {"startup": notable(lines[:at_ready]), "after_ready": notable(lines[at_ready:])}
    result["machine"] = machine()  # after the worker: this process's own CUDA context must not shrink its KV cache
    result["checks"] = checks(result, args.concurrency)
    text = table(result)
    prepared = result["prepared"]
    summary = [f"start-up to healthy: {startup_s:.1f} s"
               + (f" (prepared the {prepared['forward']} forward in {prepared['seconds']:.1f} s, "
                  f"{prepared['cuda_graphs']} CUDA graphs)" if prepared else ""),
               "checks: " + json.dumps(result["checks"])]  # fmt: skip
    print(text + "\n\n" + "\n".join(summary))
    machine_name = result["machine"].get("gpu") or result["machine"]["cpu"]
    name = "_".join(re.sub(r"\(R\)|\(TM\)|[^\w.-]", " ", machine_name).split())
    flags = "".join(f"_{flag.lstrip('-').replace('=', '_')}" for flag in args.worker_flag)
    stem = f"cold_start_{Path(args.model).stem}_{args.device.replace(':', '')}{flags}_c{args.concurrency}_{name}"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{stem}.json").write_text(json.dumps(result, indent=2) + "\n")
    (args.out / f"{stem}.md").write_text(f"{json.dumps(result['machine'])}\n\n{text}\n\n" + "\n".join(summary) + "\n")
    print(f"wrote {args.out / stem}.json and .md")


if __name__ == "__main__":
    main()
