"""Every model type of transformers' causal-LM mapping (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES) that a config alone can
build, served by the engine on the torch runtime and compared token for token with transformers' own `generate`.

For each model type: a tiny random-weight model made from its config (hidden 64, 2 layers, 4 heads, 2 KV heads where
the config has them, head_dim 16, small MoE expert counts, a sliding window of 8 where the config has one, per-layer
lists sized to the layer count, the demo tokenizer's vocabulary; weights with a wide spread, initializer_range 0.5, or
less where the model saturates: OVERRIDES), saved as a Hugging Face directory; then transformers' greedy `generate`
of NEW_TOKENS tokens after each of two short prompts (float32, on the CPU) against the engine (Engine with prompt
chunks of 4 tokens in blocks of 4, shorter than the window, and a 256 MiB KV pool): the first prompt alone, then four
requests at once, each prompt twice, where the second of each reads the blocks the first cached (the prefix-cache
hits are recorded). Each type
runs in a process of its own, forked from this one (torch and transformers imported once), stopped after --timeout
seconds, so that one crash or hang does not stop the survey. Each type is classed as

- `same`: the engine gives transformers' tokens, alone and in all four together;
- `differs`: other tokens (the first position that differs, alone and together);
- `refused`: the engine refuses the model at load (ModelLoadError: the worker exits 2), with its message;
- `error`: the engine fails otherwise (the exception's or error event's first line), or the process crashed or hung;
- `skipped`: no config alone builds a decoder-only text model of it (an encoder, an encoder-decoder, a multimodal
  class that holds a vision or audio tower, or one whose config or `generate` transformers itself cannot run), why.

The JSON and a markdown table go to bench/results/architectures/, named by the transformers version and the CPU.

    PYTHONPATH=src .venv/bin/python bench/architectures.py                    # every model type, 2 at once
    PYTHONPATH=src .venv/bin/python bench/architectures.py --types llama gpt2 --jobs 1 --no-save
"""

import argparse
import json
import multiprocessing
import os
import queue
import sys
import tempfile
import time
import traceback
from multiprocessing.connection import Connection
from pathlib import Path

import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PretrainedConfig
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, MODEL_FOR_MASKED_LM_MAPPING_NAMES

from rbee_worker.benchmark.run import machine
from rbee_worker.engine.engine import Engine
from rbee_worker.engine.engine_config import EngineConfig
from rbee_worker.engine.request_types import End, Error, Request, Token
from rbee_worker.engine.sampling.sampling_params import SamplingParams
from rbee_worker.errors import ModelLoadError
from rbee_worker.hardware.devices import resolve_placement
from rbee_worker.loading.demo import demo_model_path
from rbee_worker.loading.gguf.gguf_format import read_gguf
from rbee_worker.loading.gguf.gguf_tokenizer import build_tokenizer
from rbee_worker.loading.loader import load_model

NEW_TOKENS = 32
PROMPTS = ("Once upon a time, in a small village by the sea, there lived", "def fibonacci(n):\n    if n < 2:\n")
KV_CACHE_BYTES = 256 * 2**20
RESULTS = Path(__file__).parent / "results" / "architectures"
# Every type's shape; a key goes to a config only where its class has that field (`config_for`).
SHAPE: dict[str, object] = {
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 512, "initializer_range": 0.5,
    # Mixtures of experts: few and small experts.
    "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_topk": 2,
    "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32, "n_shared_experts": 1, "n_group": 1,
    "topk_group": 1,
    # Older configs' names of the same.
    "n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 512, "n_inner": 128, "num_layers": 2, "num_heads": 4,
    "d_model": 64, "n_heads": 4, "n_layers": 2, "ffn_hidden_size": 128, "n_ctx": 512, "dim_head": 16,
    # Partial rotary embeddings within the 16-wide heads (GPT-J, CodeGen).
    "rotary_dim": 8,
    # Latent attention (DeepSeek-V2 / V3 and their kin): keys 16 + 8 wide, values 16.
    "q_lora_rank": 32, "kv_lora_rank": 16, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
    "qk_head_dim": 24,
}  # fmt: skip
WINDOW = 8  # a config's sliding window, where it has one, so that the window changes what later tokens see
# Per type: what its config needs besides SHAPE (and the reason where it is not obvious).
OVERRIDES: dict[str, dict[str, object]] = {
    # Scaled embeddings and extra norms (Gemma), or none (MPT, XGLM), saturate at SHAPE's spread: one token over and
    # over, which would agree whatever the attention computed.
    "gemma2": {"initializer_range": 0.05},
    "gemma3_text": {"initializer_range": 0.05},
    # Two layers leave none to share keys and values with.
    "gemma3n_text": {"initializer_range": 0.05, "num_kv_shared_layers": 0},
    "mpt": {"initializer_range": 0.1},
    "xglm": {"initializer_range": 0.3},
    # Their checkpoints' convolution layers beside attention (the default config has attention layers only).
    "lfm2": {"layer_types": ["conv", "full_attention"]},
    "lfm2_moe": {"layer_types": ["conv", "full_attention"], "num_dense_layers": 1},
    "gpt_neo": {"attention_types": [[["global", "local"], 1]]},  # one global and one local layer
    "zaya": {"num_experts_per_tok": 1},  # the only count its config takes
    "mamba2": {"head_dim": 32},  # its heads span hidden_size * expand
    "kolibri1_1": {"index_num_heads": 2},  # its indexer's heads within the query heads
    "gemma4_assistant": {"hidden_size_per_layer_input": 0},  # its config's validator asks for it
    "dbrx": {"attn_config": {"rope_theta": 10000.0, "kv_n_heads": 2}},
}
# Types skipped before building, and why.
SKIPPED = {
    "fuyu": "multimodal: FuyuForCausalLM feeds image patches into its language model (text_config), whose default "
    "size the survey's shape does not reach",
    "gemma4_unified_assistant": "a drafting model of Gemma 4's speculative decoding, built around a text_config of "
    "the target's size that the survey's shape does not reach",
}


def config_for(model_type: str, vocab_size: int, eos: int | None, bos: int | None) -> PretrainedConfig:
    """The tiny config of `model_type`: SHAPE's fields that its config class has, a window of WINDOW where it has one,
    per-layer lists cut to the layer count (each kind of layer kept where there are several), OVERRIDES."""
    default = AutoConfig.for_model(model_type)
    fields = {key: value for key, value in SHAPE.items() if settable(default, key)}
    if isinstance(getattr(default, "sliding_window", None), int):
        fields["sliding_window"] = WINDOW
    fields.update(vocab_size=vocab_size, eos_token_id=eos, bos_token_id=bos, pad_token_id=eos)
    fields.update(OVERRIDES.get(model_type, {}))
    if "kv_lora_rank" in fields:  # latent attention: every query head has its keys; the rotary part sets its width
        fields.pop("head_dim", None)
        fields["num_key_value_heads"] = fields.get("num_attention_heads", 4)
    layers = fields.get("num_hidden_layers")
    kinds = getattr(default, "layer_types", None)
    if (
        isinstance(layers, int)
        and isinstance(kinds, list)
        and "layer_types" not in fields
        and settable(default, "layer_types")
    ):
        distinct = list(dict.fromkeys(kinds))  # each kind of layer of the full-size model, in its order
        fields["layer_types"] = [distinct[i % len(distinct)] for i in range(layers)]
    return AutoConfig.for_model(model_type, **fields)


def settable(config: PretrainedConfig, key: str) -> bool:
    """Whether `config` has the field `key` and takes a value for it (not a property derived from others; not an
    attribute that varies per layer, which reading raises for)."""
    key = getattr(config, "attribute_map", {}).get(key, key)  # an alias (layer_types: Bamba's layers_block_type)
    if isinstance(getattr(type(config), key, None), property):
        return False
    try:
        return hasattr(config, key)
    except Exception:  # transformers' AmbiguousGlobalPerLayerAttributeError
        return False


def skip_reason(model_type: str) -> str | None:
    """Why no config alone builds a decoder-only text model of `model_type` for the engine to serve, or None."""
    if model_type in SKIPPED:
        return SKIPPED[model_type]
    default = AutoConfig.for_model(model_type)
    class_name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]
    if getattr(default, "is_encoder_decoder", False):
        return f"an encoder-decoder: {class_name} is the decoder half of a sequence-to-sequence model"
    if model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES and not getattr(default, "is_decoder", False):
        return f"an encoder (masked LM): {class_name} is its head for use as a decoder inside another model"
    sub = sorted(getattr(default, "sub_configs", None) or {})
    towers = [name for name in sub if any(kind in name for kind in TOWERS)]
    if towers or class_name.endswith("ForConditionalGeneration"):
        text = f"{model_type}_text"
        alone = f"; its text model is {text}, surveyed on its own" if text in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES else ""
        return f"multimodal: {class_name} holds {', '.join(towers or sub)}{alone}"
    return None


TOWERS = ("vision", "audio", "vq", "encoder", "patcher")  # sub-configs of what a text-only model does not have


def run_one(model_type: str, tokenizer_dir: Path, workdir: Path, threads: int) -> dict:
    """The survey of one model type (see the module docstring): a dict with `class` and its detail."""
    torch.set_num_threads(threads)
    stage = "config"
    try:
        if reason := skip_reason(model_type):
            return {"class": "skipped", "reason": reason}
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
        config = config_for(model_type, len(tokenizer), tokenizer.eos_token_id, tokenizer.bos_token_id)
        stage = "build"
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        directory = workdir / model_type
        model.save_pretrained(directory)
        tokenizer.save_pretrained(directory)
        del model
    except Exception as exc:
        return {"class": "skipped", "reason": f"transformers' {stage} fails: {type(exc).__name__}: {first_line(exc)}"}
    config = EngineConfig(max_batch=4, prefill_chunk=4, block_size=4, kv_cache_bytes=KV_CACHE_BYTES, threads=threads)
    engine = Engine(lambda: load_model(str(directory), resolve_placement("cpu", "float32")), config)
    try:
        try:
            engine.loaded  # noqa: B018 -- raises what loading raised
        except ModelLoadError as exc:
            return {"class": "refused", "reason": first_line(exc)}
        prompts = [tokenizer(text)["input_ids"] for text in PROMPTS]
        eos = {tokenizer.eos_token_id}
        try:
            expected = [until_eos(ids, eos) for ids in reference(directory, prompts)]
        except Exception as exc:
            reason = f"transformers' generate fails: {type(exc).__name__}: {first_line(exc)}"
            return {"class": "skipped", "reason": reason}
        alone = until_eos(generated(engine, [prompts[0]])[0], eos)
        together = [until_eos(ids, eos) for ids in generated(engine, prompts * 2)]
        _, cached = engine.prefix_cache_tokens()
    except Exception as exc:
        return {"class": "error", "reason": f"{type(exc).__name__}: {first_line(exc)}"}
    finally:
        engine.close()
    record = {"expected": expected, "alone": alone, "together": together, "prefix_cache_hit_tokens": cached}
    if alone == expected[0] and together == expected * 2:
        return {"class": "same", **record}
    where = {"alone": first_difference(alone, expected[0])}
    for i, (got, want) in enumerate(zip(together, expected * 2, strict=True)):
        where[f"together[{i}]"] = first_difference(got, want)
    return {"class": "differs", "first_difference": {k: v for k, v in where.items() if v is not None}, **record}


def reference(directory: Path, prompts: list[list[int]]) -> list[list[int]]:
    """transformers' greedy tokens after each prompt, from the saved directory, as the engine loads it."""
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    out = []
    with torch.inference_mode():
        for ids in prompts:
            tensor = torch.tensor([ids])
            tokens = model.generate(
                tensor, attention_mask=torch.ones_like(tensor), max_new_tokens=NEW_TOKENS, do_sample=False
            )
            out.append(tokens[0, len(ids) :].tolist())
    return out


def generated(engine: Engine, prompts: list[list[int]], timeout: float = 60) -> list[list[int]]:
    """The engine's greedy tokens for `prompts` submitted at once; an error event raises RuntimeError."""
    streams: list[queue.SimpleQueue] = [queue.SimpleQueue() for _ in prompts]
    greedy = SamplingParams(temperature=0.0)
    for ids, events in zip(prompts, streams, strict=True):
        engine.submit(Request(tuple(ids), max_tokens=NEW_TOKENS, sampling=greedy), events.put)
    results = []
    for events in streams:
        ids: list[int] = []
        while not isinstance(event := events.get(timeout=timeout), End | Error):
            if isinstance(event, Token):
                ids.extend(event.token_ids)
        if isinstance(event, Error):
            raise RuntimeError(f"{event.code}: {event.message}")
        results.append(ids)
    return results


def until_eos(ids: list[int], eos: set[int]) -> list[int]:
    """The tokens before the first EOS (the engine stops there; transformers' `generate` too, padding the rest)."""
    for i, token in enumerate(ids):
        if token in eos:
            return ids[:i]
    return ids


def first_difference(got: list[int], expected: list[int]) -> int | None:
    """The first position where `got` and `expected` differ (one ending first counts), None where they agree."""
    if got == expected:
        return None
    return next(
        (i for i, (a, b) in enumerate(zip(got, expected, strict=False)) if a != b), min(len(got), len(expected))
    )


def first_line(exc: BaseException, limit: int = 300) -> str:
    """The first line of the exception's message (with its cause's, which says why a config's validator failed)."""
    text = (str(exc).strip() or type(exc).__name__).splitlines()[0]
    if exc.__cause__ is not None:
        text += f" ({first_line(exc.__cause__, limit)})"
    return text if len(text) <= limit else text[: limit - 1] + "…"


def child(model_type: str, tokenizer_dir: Path, workdir: Path, threads: int, pipe: Connection) -> None:
    """The forked process of one type: its result sent through `pipe`."""
    try:
        result = run_one(model_type, tokenizer_dir, workdir, threads)
    except BaseException as exc:  # a bug of this script: reported, not lost
        result = {"class": "error", "reason": f"survey: {type(exc).__name__}: {first_line(exc)}",
                  "traceback": traceback.format_exc()}  # fmt: skip
    if "reason" in result:  # the temporary directory's name says nothing
        result["reason"] = result["reason"].replace(f"{workdir}/", "")
    pipe.send(result)
    pipe.close()
    os._exit(0)  # no exit handlers of the parent's (the engine's threads are daemons)


def survey(types: list[str], timeout: float, jobs: int, threads: int) -> dict[str, dict]:
    """Each type's result (run_one) from a forked process of its own, `jobs` at a time; one that runs past `timeout`
    seconds is killed and classed `error`, as is one that dies without a result."""
    context = multiprocessing.get_context("fork")
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="rbee-architectures-") as tmp:
        workdir = Path(tmp)
        tokenizer_dir = workdir / "demo-tokenizer"
        build_tokenizer(read_gguf(demo_model_path()).metadata).save_pretrained(tokenizer_dir)
        pending = list(types)
        running: dict[str, tuple[multiprocessing.Process, Connection, float]] = {}
        while pending or running:
            while pending and len(running) < jobs:
                model_type = pending.pop(0)
                receive, send = context.Pipe(duplex=False)
                process = context.Process(target=child, args=(model_type, tokenizer_dir, workdir, threads, send))
                process.start()
                send.close()
                running[model_type] = (process, receive, time.monotonic())
            time.sleep(0.1)
            for model_type, (process, receive, started) in list(running.items()):
                elapsed = time.monotonic() - started
                result = None
                if receive.poll():
                    try:
                        result = receive.recv()
                    except EOFError:
                        result = {"class": "error", "reason": f"the process died (exit code {process.exitcode})"}
                elif not process.is_alive():
                    process.join()
                    result = {"class": "error", "reason": f"the process died (exit code {process.exitcode})"}
                elif elapsed > timeout:
                    process.kill()
                    result = {"class": "error", "reason": f"no result within {timeout:.0f} s (killed)"}
                if result is None:
                    continue
                process.join(5)
                receive.close()
                del running[model_type]
                results[model_type] = {**result, "seconds": round(elapsed, 1)}
                print(f"{model_type:28} {result['class']:8} {summary(result)}", flush=True)
    return results


def summary(result: dict) -> str:
    """A result's detail in one line: the reason, where the tokens first differ, or the prefix cache's hits."""
    if result["class"] == "differs":
        return "first differs at " + ", ".join(f"{k} {v}" for k, v in result["first_difference"].items())
    if result["class"] == "same":
        return f"{result['prefix_cache_hit_tokens']} prompt tokens read from the prefix cache"
    return result.get("reason", "")


def save(results: dict[str, dict], info: dict) -> Path:
    """The JSON and the markdown table under RESULTS, named by the transformers version and the CPU."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    cpu = "_".join(str(info["cpu"]).split()[:3])
    stem = RESULTS / f"architectures_transformers-{info['transformers']}_{cpu}"
    stem.with_name(stem.name + ".json").write_text(json.dumps({"machine": info, "results": results}, indent=1) + "\n")
    counts = {kind: sum(r["class"] == kind for r in results.values()) for kind in CLASSES}
    lines = [
        f"# Model types of transformers {info['transformers']}'s causal-LM mapping on the torch runtime",
        "",
        f"bench/architectures.py: {len(results)} model types; float32 greedy, {NEW_TOKENS} new tokens, on "
        f"{info['cpu']} ({info['cores']} cores), torch {info['torch']}, transformers {info['transformers']}.",
        "",
        ", ".join(f"{kind} {count}" for kind, count in counts.items()),
        "",
        "| model type | class | detail |",
        "|---|---|---|",
    ]
    for kind in CLASSES:
        for model_type, result in sorted(results.items()):
            if result["class"] == kind:
                detail = summary(result).replace("|", "\\|")
                lines.append(f"| {model_type} | {kind} | {detail} |")
    stem.with_name(stem.name + ".md").write_text("\n".join(lines) + "\n")
    return stem


CLASSES = ("same", "differs", "refused", "error", "skipped")


def main() -> None:
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--types", nargs="*", help="these model types only (default: every one of the mapping)")
    parser.add_argument("--timeout", type=float, default=60, help="seconds a type may take (default 60)")
    parser.add_argument("--jobs", type=int, default=2, help="types surveyed at once (default 2)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of each type's process (default 1)")
    parser.add_argument("--no-save", action="store_true", help="print only, write no results")
    args = parser.parse_args()
    types = args.types or sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    if unknown := sorted(set(types) - set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)):
        sys.exit(f"not in transformers' causal-LM mapping: {', '.join(unknown)}")
    info = {**machine(), "transformers": transformers.__version__}
    print(f"transformers {info['transformers']}, torch {info['torch']}, {info['cpu']}: {len(types)} model types")
    results = survey(types, args.timeout, args.jobs, args.threads)
    counts = {kind: sum(r["class"] == kind for r in results.values()) for kind in CLASSES}
    print(", ".join(f"{kind} {count}" for kind, count in counts.items()))
    if not args.no_save:
        print(f"saved {save(results, info)}.{{json,md}}")


if __name__ == "__main__":
    main()
