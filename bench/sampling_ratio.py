"""Sampled traffic against greedy traffic on one worker process: what a chat client's settings cost.

One `rbee-worker serve` process, measured through /v1/completions (streamed, as `rbee-worker bench` does) in
--repeats rounds of every sampling mode in turn (the order reversed every other round): single-stream decode tokens/s
and aggregate tokens/s at each --concurrency, medians over the rounds; each ratio to greedy is the median of the
rounds' ratios, a mode's run against greedy's run of the same round, a minute apart at most. Optionally transformers'
continuous batching (`--peer-cb`) at the highest concurrency, greedy, in the same call.

    python bench/sampling_ratio.py --model demo --device cpu --concurrency 1,16
    python bench/sampling_ratio.py --model /tmp/m8b --device cuda --dtype bfloat16 --concurrency 1,64 --peer-cb
"""

import argparse
import asyncio
import json
import re
import statistics
import tempfile
from pathlib import Path

from rbee_worker.benchmark.peers import SAMPLING_MODES
from rbee_worker.benchmark.run import build_spec, machine, measure_worker, run_peer, start_worker

MODES = SAMPLING_MODES


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--concurrency", default="1,16")
    parser.add_argument("--gen-tokens", type=int, default=128)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="torch threads of the peer")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--worker-flag", action="append", default=[])
    parser.add_argument("--peer-cb", action="store_true", help="transformers' continuous batching, greedy")
    parser.add_argument("--out", type=Path, default=Path("bench/results/sampling"))
    args = parser.parse_args()
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    args.sampling = "greedy"
    spec = build_spec(args)
    modes = args.modes.split(",")
    if "greedy" not in modes:
        parser.error("--modes must include greedy: every ratio is taken against it")
    result: dict = {"machine": machine(), "model": args.model, "device": args.device, "dtype": args.dtype,
                    "worker_flags": args.worker_flag, "modes": {}}  # fmt: skip
    with tempfile.TemporaryDirectory() as scratch:
        log_path = Path(scratch) / "worker.log"
        process, url, startup_s = start_worker(args, log_path)
        try:
            # One untimed pass of every mode at every concurrency first: the first many-stream run also touches the
            # KV cache's memory for the first time, and a mode's first steps may capture CUDA graphs (logprobs), which
            # would count against whichever round came first. The timed rounds measure a worker in steady state.
            for mode in modes:
                asyncio.run(measure_worker(url, spec | {"repeats": 1, "sampling": MODES[mode]}))
            # Rounds of every mode in turn, each round's ratios to its own greedy run: the speed of a shared VM drifts
            # by 10-15% within a minute, so runs far apart compare the machine's spells, not the modes. Reversing the
            # order every other round keeps a mode from always running right after the same neighbour.
            rounds: dict[str, list[dict]] = {mode: [] for mode in modes}
            for repeat in range(args.repeats):
                for mode in modes if repeat % 2 == 0 else modes[::-1]:
                    once = spec | {"repeats": 1, "sampling": MODES[mode]}
                    rounds[mode].append(asyncio.run(measure_worker(url, once)))
            for mode, runs in rounds.items():
                keys = ["decode_tok_s", *(f"aggregate_tok_s@{c}" for c in args.concurrency)]
                over_greedy = {
                    key: [figure(r, key) / figure(g, key) for r, g in zip(runs, rounds["greedy"], strict=True)]
                    for key in keys
                }
                result["modes"][mode] = {
                    "decode_tok_s": statistics.median(r["decode_tok_s"] for r in runs),
                    "aggregate_tok_s": {
                        str(c): statistics.median(r["aggregate_tok_s"][str(c)] for r in runs) for c in args.concurrency
                    },
                    "x_greedy": {key: statistics.median(values) for key, values in over_greedy.items()},
                    "x_greedy_rounds": over_greedy,
                    "runs": runs,
                }
                print(mode, json.dumps({k: result["modes"][mode][k] for k in ("decode_tok_s", "aggregate_tok_s")}))
        finally:
            process.terminate()
            process.wait(timeout=60)
    result["startup_s"] = startup_s
    greedy = result["modes"]["greedy"]
    lines = ["| mode | decode tok/s | x greedy | " + " | ".join(f"agg@{c} | x greedy" for c in args.concurrency) + " |"]
    lines.append("|" + "---|" * (3 + 2 * len(args.concurrency)))
    for mode, figures in result["modes"].items():
        ratio = figures["x_greedy"]
        cells = [mode, f"{figures['decode_tok_s']:.1f}", f"{ratio['decode_tok_s']:.3f}"]
        for c in map(str, args.concurrency):
            cells += [f"{figures['aggregate_tok_s'][c]:.0f}", f"{ratio[f'aggregate_tok_s@{c}']:.3f}"]
        lines.append("| " + " | ".join(cells) + " |")
    if args.peer_cb:
        top = max(args.concurrency)
        peer = run_peer("transformers-cb", args, spec | {"concurrency": [top]})
        result["transformers-cb"] = peer
        if "aggregate_tok_s" in peer:
            ratio = greedy["aggregate_tok_s"][str(top)] / peer["aggregate_tok_s"][str(top)]
            result["greedy_over_transformers_cb"] = ratio
            lines.append(f"\ntransformers continuous batching at {top}: {peer['aggregate_tok_s'][str(top)]:.0f} tok/s "
                         f"(rbee-worker greedy {ratio:.1f}x)")  # fmt: skip
    table = "\n".join(lines)
    print(table)
    machine_name = result["machine"].get("gpu") or result["machine"]["cpu"]
    name = "_".join(re.sub(r"\(R\)|\(TM\)|[^\w.-]", " ", machine_name).split())
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"sampling_ratio_{Path(args.model).stem}_{args.device.replace(':', '')}_{name}"
    (args.out / f"{stem}.json").write_text(json.dumps(result, indent=2) + "\n")
    (args.out / f"{stem}.md").write_text(f"{json.dumps(result['machine'])}\n\n{table}\n")


def figure(run: dict, key: str) -> float:
    """One of a run's figures: decode_tok_s, or aggregate_tok_s@<concurrency>."""
    name, _, concurrency = key.partition("@")
    return run[name][concurrency] if concurrency else run[name]


if __name__ == "__main__":
    main()
