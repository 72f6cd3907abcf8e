"""The peers a user would pick instead of rbee-worker, measured on the same weights, dtype and prompt ids.

Run as `python -m rbee_worker.benchmark.peers PEER --model M --device D --dtype T --spec JSON`: one peer per fresh
process (torch's CPU kernels run at half speed on a second thread of a process that already used them, see
engine.py), printing one JSON object of results on its last stdout line.

Every system generates with the spec's sampling (`--sampling`: greedy, or temperature 0.7 and top_p 0.9).

- transformers: `generate` on the model rbee-worker's loader builds (the same weights and dtype), batch 1:
  time to first token and decode tokens/s; and one bare forward over the long prompt (the TTFT floor).
- transformers-static: the same with `cache_implementation="static"` (transformers then compiles the forward).
- transformers-cb: transformers' continuous batching (`generate_batch`), aggregate tokens/s at each concurrency.
- llama.cpp: llama-cpp-python on the same GGUF file (an optional extra), batch 1; on a CPU with AMX, decode from its
  AMX buffers and time to first token from its plain ones (benchmark/llama_cpp.py says why).
"""

import argparse
import json
import statistics
import sys
import time
from typing import Any

PEERS = ("transformers", "transformers-static", "transformers-cb", "llama.cpp")
# The llama.cpp peer's several-stream figures alone (batched_figures), which the bench runs between the worker's own
# runs at each concurrency (benchmark/run.py).
BARE_LOOP = "llama.cpp-batched"
# Peers that are rbee-worker itself with other flags, served and measured as the worker is (benchmark/run.py): the
# torch runtime where the worker's default picks llama.cpp (a GGUF file on a CPU).
WORKER_PEERS = {"rbee-torch": ["--runtime=torch"]}
CONCURRENCY = [1, 4, 16, 64]  # the bench's default stream counts
# `--sampling`: greedy, or a chat client's usual settings. Every system gets only these filters (llama.cpp's own
# default top_k 40 and min_p 0.05 are turned off), so all draw from the same distribution.
SAMPLING = {"greedy": {"temperature": 0.0, "top_p": 1.0}, "chat": {"temperature": 0.7, "top_p": 0.9}}
# What bench/sampling_ratio.py and bench/cold_start.py run: greedy, chat, and chat with each costlier sampler stage.
SAMPLING_MODES = {
    "greedy": {"temperature": 0.0},
    "chat": SAMPLING["chat"],
    "chat+top_k50": SAMPLING["chat"] | {"top_k": 50},
    "chat+repetition1.1": SAMPLING["chat"] | {"repetition_penalty": 1.1},
    "chat+logprobs5": SAMPLING["chat"] | {"logprobs": 5},
}


def transformers_sampling(spec: dict) -> dict:
    """generate's arguments for the spec's sampling (transformers samples only with do_sample)."""
    sampling = spec["sampling"]
    if sampling["temperature"] == 0:
        return {"do_sample": False}
    return {"do_sample": True, "top_k": 0, **sampling}


def run_transformers(args: argparse.Namespace, spec: dict, static: bool) -> dict:
    import torch
    from transformers.generation.streamers import BaseStreamer

    from rbee_worker.hardware.devices import resolve_placement
    from rbee_worker.loading.loader import load_model

    model = load_model(args.model, resolve_placement(args.device, args.dtype)).model
    device = model.device

    class Clock(BaseStreamer):
        """generate calls put() with the prompt, then once per new token (batch 1)."""

        def __init__(self) -> None:
            self.times: list[float] = []

        def put(self, value: Any) -> None:
            self.times.append(time.perf_counter())

        def end(self) -> None:
            pass

    def generate(prompt: list[int], tokens: int) -> tuple[float, float]:
        """(seconds to the first token, decode tokens/s after it)."""
        clock = Clock()
        started = time.perf_counter()
        kwargs = {"cache_implementation": "static"} if static else {}
        model.generate(
            torch.tensor([prompt], device=device),
            max_new_tokens=tokens,
            min_new_tokens=tokens,
            streamer=clock,
            **transformers_sampling(spec),
            **kwargs,
        )
        first, last = clock.times[1], clock.times[-1]
        return first - started, (tokens - 1) / (last - first)

    def bare_forward() -> float:
        ids = torch.tensor([spec["long_prompt"]], device=device)
        sync(device)
        started = time.perf_counter()
        with torch.inference_mode():
            model(input_ids=ids, use_cache=True, logits_to_keep=1)
        sync(device)
        return time.perf_counter() - started

    # Warm-up as long as a measured run (and compilation, for the static cache): after a shorter one the first
    # measured run of a large model on a GPU is much slower than the next (bench/results/README.md).
    generate(spec["short_prompt"], spec["gen_tokens"])
    bare_forward()
    decode = [generate(spec["short_prompt"], spec["gen_tokens"])[1] for _ in range(spec["repeats"])]
    ttft = [generate(spec["long_prompt"], 2)[0] for _ in range(spec["repeats"])]
    forward = [bare_forward() for _ in range(spec["repeats"])]
    return {
        "decode_tok_s": statistics.median(decode),
        "ttft_s": statistics.median(ttft),
        "bare_forward_s": statistics.median(forward),
        "weight_bytes": sum(p.nbytes for p in model.parameters()),
        "runs": {"decode_tok_s": decode, "ttft_s": ttft, "bare_forward_s": forward},
    }


def run_transformers_cb(args: argparse.Namespace, spec: dict) -> dict:
    from transformers import GenerationConfig

    from rbee_worker.hardware.devices import resolve_placement
    from rbee_worker.loading.loader import load_model

    model = load_model(args.model, resolve_placement(args.device, args.dtype)).model
    # An end-of-sequence id that never comes: every sequence generates gen_tokens, as rbee-worker's ignore_eos.
    config = GenerationConfig(
        max_new_tokens=spec["gen_tokens"], eos_token_id=-1, pad_token_id=0, **transformers_sampling(spec)
    )
    aggregate = {}
    for concurrency in spec["concurrency"]:
        prompts = [spec["short_prompt"] + [i] for i in spec["distinct_ids"][:concurrency]]
        model.generate_batch(inputs=prompts[:1], generation_config=config)  # warm-up
        started = time.perf_counter()
        outputs = model.generate_batch(inputs=prompts, generation_config=config)
        elapsed = time.perf_counter() - started
        tokens = sum(len(o.generated_tokens) for o in outputs.values())
        aggregate[str(concurrency)] = tokens / elapsed
    return {"aggregate_tok_s": aggregate}


def run_llama_cpp(args: argparse.Namespace, spec: dict) -> dict:
    from rbee_worker.benchmark.llama_cpp import has_amx, open_llama

    threads = spec.get("threads") or None
    options = {"n_ctx": 4096, "n_threads": threads, "n_threads_batch": threads, "verbose": False}
    # With AMX, llama.cpp decodes fastest from its AMX buffers but crashes there on batches of several tokens (see
    # benchmark/llama_cpp.py): decode is timed from those, fed the prompt one token at a time (only the tokens after
    # the first are timed), and time to first token from the plain buffers. Decode from the plain buffers is timed
    # too (`plain_decode_tok_s`): a llama.cpp server on such a CPU needs them (`--no-repack`) to take any prompt.
    amx = has_amx()
    llm = open_llama(args.model, plain_buffers=False, n_batch=1 if amx else 512, **options)
    eos = llm.token_eos()

    def generate(llm: Any, prompt: list[int], tokens: int) -> tuple[float, float]:
        started = time.perf_counter()
        times = []
        completion = llm.create_completion(
            prompt, max_tokens=tokens, stream=True, logit_bias={eos: -1e9}, top_k=0, min_p=0.0, **spec["sampling"]
        )
        for _ in completion:
            times.append(time.perf_counter())
        llm.reset()
        return times[0] - started, (len(times) - 1) / (times[-1] - times[0])

    generate(llm, spec["short_prompt"], spec["gen_tokens"])  # warm-up, as long as a measured run
    decode = [generate(llm, spec["short_prompt"], spec["gen_tokens"])[1] for _ in range(spec["repeats"])]
    if amx:
        llm.close()
        llm = open_llama(args.model, plain_buffers=True, **options)
    ttft = [generate(llm, spec["long_prompt"], 2)[0] for _ in range(spec["repeats"])]
    result: dict = {
        "decode_tok_s": statistics.median(decode),
        "ttft_s": statistics.median(ttft),
        "runs": {"decode_tok_s": decode, "ttft_s": ttft},
        "amx": amx,
    }
    if amx:
        plain = [generate(llm, spec["short_prompt"], spec["gen_tokens"])[1] for _ in range(spec["repeats"])]
        result["plain_decode_tok_s"] = statistics.median(plain)
        result["runs"]["plain_decode_tok_s"] = plain
    llm.close()
    batched = batched_figures(args, spec)
    result["runs"] |= batched.pop("runs")
    return result | batched


def batched_figures(args: argparse.Namespace, spec: dict) -> dict:
    """Several streams: llama.cpp's own batched decode (a bare llama_decode loop, one sequence per stream, sampling as
    the spec says with llama.cpp's own samplers), the most a server on llama.cpp's runtime can reach, --repeats runs
    at each of the spec's concurrencies: aggregate_tok_s over the same work as the worker's (the prompts and every
    token), decode_aggregate_tok_s over the decode steps alone."""
    from rbee_worker.benchmark.llama_cpp import batched_decode

    result: dict = {"aggregate_tok_s": {}, "decode_aggregate_tok_s": {}, "runs": {}}
    for concurrency in spec["concurrency"]:
        prompts = [spec["short_prompt"] + [i] for i in spec["distinct_ids"][:concurrency]]
        runs = [
            batched_decode(args.model, spec.get("threads") or None, prompts, spec["gen_tokens"], spec["sampling"])
            for _ in range(spec["repeats"])
        ]
        for figure in ("aggregate_tok_s", "decode_aggregate_tok_s"):
            values = [getattr(run, figure) for run in runs]
            result[figure][str(concurrency)] = statistics.median(values)
            result["runs"][f"{figure}@{concurrency}"] = values
    return result


def sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("peer", choices=[*PEERS, BARE_LOOP])
    parser.add_argument("--model", required=True)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--spec", required=True, help="JSON: prompts, gen_tokens, repeats, concurrency")
    args = parser.parse_args()
    spec = json.loads(args.spec)
    if spec.get("threads"):
        import torch

        torch.set_num_threads(spec["threads"])
    if args.peer == "transformers-cb":
        result = run_transformers_cb(args, spec)
    elif args.peer == "llama.cpp":
        result = run_llama_cpp(args, spec)
    elif args.peer == BARE_LOOP:
        result = batched_figures(args, spec)
    else:
        result = run_transformers(args, spec, static=args.peer == "transformers-static")
    print(json.dumps(result))


if __name__ == "__main__":
    sys.exit(main())
