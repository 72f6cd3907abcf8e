"""xgrammar against llguidance, the two maintained grammar engines vLLM offers, on the grammars this worker compiles:
what each costs a constrained token and a request, for the same token sequences, on the model's tokenizer.

The worker constrains decoding with xgrammar (engine/structured/grammar.py); this bench is the measurement behind that
choice, and reruns it on any machine. Both engines compute a row's allowed tokens on the host into the same layout
(int32 words, bit b of word j for token 32 * j + b), so the sampler's device-side masking is the same for either: what
differs is host time. For each grammar:

- `compile ms`: from the schema to a request's first mask (xgrammar: compile_json_schema, a matcher, the first fill;
  llguidance: grammar_from_json_schema, a matcher, the first fill), each engine's own caches off, median of --repeats;
- `matcher us`: a new request's matcher for a grammar already compiled (xgrammar's cache, llguidance's deep copy);
- `fill us` / `accept us`: one row, per token of a valid output (the compact JSON of seeded random instances,
  tokenized as the model would write them, then the end-of-sequence token): the mask's fill and the token's accept;
- `batch fill us`: --batch rows at once, each at its own instance, per row and step: xgrammar's
  BatchGrammarMatcher.batch_fill_next_token_bitmask against llguidance's fill_next_token_bitmask_par, both on
  --threads threads (default: xgrammar's own default, half the hardware threads); `batch accept us` likewise
  (BatchGrammarMatcher.batch_accept_token against consume_token_par);
- `steps allowing more`: steps of the one-row replays at which the engine's mask allows a token the other's does not
  (over the tokenizer's ids), and the first such token.

The grammars are the worker's: the structured-output bench's schema (a list of 4 objects: enums, an integer range, a
bounded array, string patterns, a nested object), `json_object`, and the forced tool call of two tools
(chat/tools.forced_grammar, tool_choice "required"), all written compactly (xgrammar any_whitespace=False; llguidance
whitespace_flexible=False with the same separators).

    pip install llguidance   # the worker does not need it; this bench does
    PYTHONPATH=src python bench/grammar_engines.py
    PYTHONPATH=src python bench/grammar_engines.py --vocab-size 128256   # the 8B shape's logits width
"""

import argparse
import json
import os
import random
import re
import statistics
import sys
import time
from collections.abc import Callable
from importlib.metadata import version
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from rbee_worker.benchmark.run import machine
from rbee_worker.chat.tools import forced_grammar
from rbee_worker.engine.structured.grammar import host_bitmask, tokenizer_info
from rbee_worker.hardware.cpu_features import cpu_features
from rbee_worker.loading.demo import demo_model_path
from rbee_worker.loading.gguf.gguf_format import read_gguf
from rbee_worker.loading.gguf.gguf_tokenizer import build_tokenizer

sys.path.insert(0, str(Path(__file__).parent))
from structured_output import NAMED_FLAGS, schema

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
                "required": ["city", "unit"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "search",
            "parameters": {
                "type": "object",
                "properties": {"query": {"type": "string"}, "limit": {"type": "integer", "minimum": 1, "maximum": 10}},
                "required": ["query", "limit"],
            },
        },
    },
]
NAMES = ["Alice", "Bob", "Carol", "Dmitri", "Eve", "Farida", "Gustavo", "Hana", "Ivan", "Joanna", "Kofi", "Lena"]
CITIES = ["Paris", "Lagos", "Osaka", "Lima", "Toronto", "Nairobi", "Oslo", "Hanoi", "Quito", "Perth", "Bern"]
WORDS = ["alpha", "beta", "gamma", "delta", "red", "blue", "sky", "river", "stone", "cloud", "north", "south"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokenizer", help="a Hugging Face tokenizer directory (default: the demo model's)")
    parser.add_argument("--vocab-size", type=int, help="the logits' width (default: the tokenizer's)")
    parser.add_argument("--batch", type=int, default=64, help="rows filled at once")
    parser.add_argument("--threads", type=int, help="the batch fillers' threads (default: half the hardware threads)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path("bench/results/grammar_engines"))
    return parser.parse_args(argv)


def people(rng: random.Random) -> list[dict]:
    return [
        {
            "name": rng.choice(NAMES),
            "age": rng.randint(18, 99),
            "color": rng.choice(["red", "green", "blue"]),
            "pets": rng.sample(["cat", "dog", "bee"], rng.randint(1, 3)),
            "address": {"city": rng.choice(CITIES), "zip": f"{rng.randint(0, 99999):05d}"},
        }
        for _ in range(4)
    ]


def any_object(rng: random.Random, depth: int = 0) -> dict:
    value: dict[str, Any] = {}
    for _ in range(rng.randint(2, 4)):
        kind = rng.choice(["text", "number", "list", "object"] if depth < 2 else ["text", "number"])
        value[rng.choice(WORDS) + str(rng.randint(0, 9))] = {
            "text": lambda: " ".join(rng.choices(WORDS, k=rng.randint(1, 4))),
            "number": lambda: rng.choice([rng.randint(-500, 5000), round(rng.uniform(-10, 10), 3)]),
            "list": lambda: [rng.randint(0, 99) for _ in range(rng.randint(0, 4))],
            "object": lambda: any_object(rng, depth + 1),
        }[kind]()
    return value


def tool_call(rng: random.Random) -> list[dict]:
    if rng.random() < 0.5:
        arguments: dict[str, Any] = {"city": rng.choice(CITIES), "unit": rng.choice(["celsius", "fahrenheit"])}
        return [{"name": "get_weather", "parameters": arguments}]
    return [{"name": "search", "parameters": {"query": " ".join(rng.choices(WORDS, k=3)), "limit": rng.randint(1, 10)}}]


GRAMMARS: dict[str, tuple[dict | None, Callable[[random.Random], Any]]] = {
    "people": (schema(4), people),
    "json_object": (None, any_object),
    "tool_required": (json.loads(forced_grammar(TOOLS, "required", parallel=False).text), tool_call),
}


class XGrammar:
    name = "xgrammar"

    def __init__(self, tokenizer: Any, vocab_size: int, stop_ids: frozenset[int], threads: int) -> None:
        import xgrammar

        self.xgr = xgrammar
        self.info = tokenizer_info(tokenizer, vocab_size, stop_ids)
        self.compiler = xgrammar.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        self.batcher = xgrammar.BatchGrammarMatcher(max_threads=threads)
        self.version = version("xgrammar")

    def compile(self, schema_: dict | None) -> Any:
        return self.compiler.compile_json_schema(json.dumps(schema_ or {"type": "object"}), any_whitespace=False)

    def matcher(self, compiled: Any) -> Any:
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, matcher: Any, bitmask: np.ndarray, row: int) -> None:
        matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, matcher: Any, token: int) -> bool:
        return matcher.accept_token(token)

    def batch_fill(self, matchers: list, bitmask: np.ndarray, rows: list[int]) -> None:
        self.batcher.batch_fill_next_token_bitmask(matchers, bitmask, rows)

    def batch_accept(self, matchers: list, tokens: list[int]) -> list[bool]:
        return list(self.xgr.BatchGrammarMatcher.batch_accept_token(matchers, tokens))


class LLGuidance:
    name = "llguidance"
    OPTIONS: ClassVar[dict] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

    def __init__(self, tokenizer: Any, vocab_size: int, stop_ids: frozenset[int], threads: int) -> None:
        import llguidance
        import llguidance.hf
        import llguidance.numpy

        self.llg = llguidance
        self.np = llguidance.numpy
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=sorted(stop_ids))
        self.executor = llguidance.LLExecutor(num_threads=threads)
        self.version = version("llguidance")

    def compile(self, schema_: dict | None) -> Any:
        grammar = self.llg.LLMatcher.grammar_from_json_schema(schema_ or {"type": "object"}, defaults=self.OPTIONS)
        matcher = self.llg.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise RuntimeError(matcher.get_error())
        return matcher

    def matcher(self, compiled: Any) -> Any:
        return compiled.deep_copy()

    def fill(self, matcher: Any, bitmask: np.ndarray, row: int) -> None:
        self.np.fill_next_token_bitmask(matcher, bitmask, row)

    def accept(self, matcher: Any, token: int) -> bool:
        return matcher.consume_token(token)

    def batch_fill(self, matchers: list, bitmask: np.ndarray, rows: list[int]) -> None:
        self.np.fill_next_token_bitmask_par(self.executor, list(zip(matchers, rows, strict=True)), bitmask)

    def batch_accept(self, matchers: list, tokens: list[int]) -> list[bool]:
        return self.np.consume_token_par(self.executor, list(zip(matchers, tokens, strict=True)))


def sequences(tokenizer: Any, make: Callable[[random.Random], Any], eos: int, count: int) -> list[list[int]]:
    """`count` valid outputs as token ids: seeded instances written as the worker's grammars write JSON (one line,
    ", " and ": "), tokenized without special tokens, then the end-of-sequence token."""
    return [[*tokenizer.encode(json.dumps(make(random.Random(seed))), add_special_tokens=False), eos]
            for seed in range(count)]  # fmt: skip


def bitmask(rows: int, vocab_size: int) -> np.ndarray:
    """The worker's host bitmask (every token allowed), as the numpy array both engines fill."""
    return host_bitmask(rows, vocab_size).numpy()


def compile_ms(engine: Any, schema_: dict | None, vocab_size: int, repeats: int) -> float:
    times = []
    mask = bitmask(1, vocab_size)
    for _ in range(repeats):
        started = time.perf_counter()
        matcher = engine.matcher(engine.compile(schema_))
        engine.fill(matcher, mask, 0)
        times.append(time.perf_counter() - started)
    return 1000 * statistics.median(times)


def one_row(
    engine: Any, compiled: Any, tokens: list[int], vocab_size: int
) -> tuple[float, float, float, list[np.ndarray]]:
    """A new matcher's time, then the fill and accept time per token over `tokens`, and the masks filled."""
    mask = bitmask(1, vocab_size)
    started = time.perf_counter()
    matcher = engine.matcher(compiled)
    made = time.perf_counter() - started
    fill = accept = 0.0
    masks = []
    for token in tokens:
        started = time.perf_counter()
        engine.fill(matcher, mask, 0)
        filled = time.perf_counter()
        if not engine.accept(matcher, token):
            raise RuntimeError(f"{engine.name} refused token {token} of a valid output")
        accept += time.perf_counter() - filled
        fill += filled - started
        masks.append(mask[0].copy())
    return made, fill / len(tokens), accept / len(tokens), masks


def batch(engine: Any, compiled: Any, rows: list[list[int]], vocab_size: int) -> tuple[float, float]:
    """Every row's matcher stepped together through its own tokens (a row leaves when its tokens end): fill and
    accept time per row and step."""
    matchers = [engine.matcher(compiled) for _ in rows]
    mask = bitmask(len(rows), vocab_size)
    fill = accept = 0.0
    row_steps = 0
    for step in range(max(map(len, rows))):
        active = [i for i, tokens in enumerate(rows) if step < len(tokens)]
        started = time.perf_counter()
        engine.batch_fill([matchers[i] for i in active], mask, active)
        filled = time.perf_counter()
        accepted = engine.batch_accept([matchers[i] for i in active], [rows[i][step] for i in active])
        accept += time.perf_counter() - filled
        fill += filled - started
        if not all(accepted):
            raise RuntimeError(f"{engine.name} refused a token of a valid output in the batch")
        row_steps += len(active)
    return fill / row_steps, accept / row_steps


def measure(engines: list, tokenizer: Any, vocab_size: int, args: argparse.Namespace) -> list[dict]:
    eos = tokenizer.eos_token_id
    rows = []
    for grammar, (schema_, make) in GRAMMARS.items():
        seqs = sequences(tokenizer, make, eos, max(args.batch, args.repeats))
        masks: dict[str, list[list[np.ndarray]]] = {}
        for engine in engines:
            compiled = engine.compile(schema_)
            runs = [one_row(engine, compiled, seqs[i], vocab_size) for i in range(args.repeats)]
            masks[engine.name] = [run[3] for run in runs]
            repeats = max(1, args.repeats // 2)
            batch_runs = [batch(engine, compiled, seqs[: args.batch], vocab_size) for _ in range(repeats)]
            rows.append({
                "grammar": grammar,
                "engine": engine.name,
                "compile_ms": compile_ms(engine, schema_, vocab_size, args.repeats),
                "matcher_us": 1e6 * statistics.median(run[0] for run in runs),
                "fill_us": 1e6 * statistics.median(run[1] for run in runs),
                "accept_us": 1e6 * statistics.median(run[2] for run in runs),
                "batch_fill_us": 1e6 * statistics.median(run[0] for run in batch_runs),
                "batch_accept_us": 1e6 * statistics.median(run[1] for run in batch_runs),
                "tokens": statistics.mean(len(seqs[i]) for i in range(args.repeats)),
            })  # fmt: skip
        found = mask_diffs(masks["xgrammar"], masks["llguidance"], len(tokenizer))
        steps = sum(map(len, masks["xgrammar"]))
        for row in rows[-2:]:
            row["only_allowed_steps"], row["steps"] = found[row["engine"]][0], steps
            token = found[row["engine"]][1]
            row["only_allowed_first"] = None if token is None else [token, tokenizer.decode([token])]
    return rows


def mask_diffs(first: list, second: list, ids: int) -> dict[str, list]:
    """For each engine, the steps at which its mask allows some token of the tokenizer's `ids` that the other's does
    not, and the first such token."""
    found: dict[str, list] = {"xgrammar": [0, None], "llguidance": [0, None]}
    for run_a, run_b in zip(first, second, strict=True):
        for a, b in zip(run_a, run_b, strict=True):
            bits_a = np.unpackbits(a.view(np.uint8), bitorder="little")[:ids].astype(bool)
            bits_b = np.unpackbits(b.view(np.uint8), bitorder="little")[:ids].astype(bool)
            for name, only in (("xgrammar", bits_a & ~bits_b), ("llguidance", bits_b & ~bits_a)):
                if only.any():
                    found[name][0] += 1
                    found[name][1] = found[name][1] if found[name][1] is not None else int(np.flatnonzero(only)[0])
    return found


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.tokenizer:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    else:
        tokenizer = build_tokenizer(read_gguf(demo_model_path()).metadata)
    vocab_size = args.vocab_size or len(tokenizer)
    threads = args.threads or max(1, (os.cpu_count() or 2) // 2)
    stop_ids = frozenset({tokenizer.eos_token_id})
    engines, setup = [], {}
    for kind in (XGrammar, LLGuidance):
        started = time.perf_counter()
        engines.append(kind(tokenizer, vocab_size, stop_ids, threads))
        setup[kind.name] = 1000 * (time.perf_counter() - started)
    isa = {"isa": cpu_features().isa, "flags": sorted(cpu_features().flags & NAMED_FLAGS)}
    result = {
        "machine": machine() | isa,
        "engines": {engine.name: engine.version for engine in engines},
        "tokenizer": args.tokenizer or "demo (SmolLM2-135M-Instruct)",
        "tokenizer_ids": len(tokenizer),
        "vocab_size": vocab_size,
        "threads": threads,
        "setup_ms": setup,
        "args": vars(args) | {"out": str(args.out)},
        "rows": measure(engines, tokenizer, vocab_size, args),
    }
    print_table(result)
    args.out.mkdir(parents=True, exist_ok=True)
    cpu = re.sub(r"[^A-Za-z0-9]", "", result["machine"]["cpu"].split()[0])
    name = f"{cpu}_{result['machine']['isa']}_threads{threads}_vocab{vocab_size}.json"
    (args.out / name).write_text(json.dumps(result, indent=1))
    print(f"saved {args.out / name}")
    return 0


def print_table(result: dict) -> None:
    print(f"\n{result['tokenizer']} ({result['tokenizer_ids']} ids, logits {result['vocab_size']} wide), "
          f"{result['threads']} batch threads, {result['engines']}, {result['machine']}")  # fmt: skip
    print("tokenizer setup ms: " + ", ".join(f"{name} {ms:.0f}" for name, ms in result["setup_ms"].items()))
    print("| grammar | engine | tokens | compile ms | matcher us | fill us | accept us | batch fill us | "
          "batch accept us | steps allowing more | first such token |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for row in result["rows"]:
        first = row["only_allowed_first"]
        print(
            f"| {row['grammar']} | {row['engine']} | {row['tokens']:.0f} | {row['compile_ms']:.1f} "
            f"| {row['matcher_us']:.1f} | {row['fill_us']:.1f} | {row['accept_us']:.1f} | {row['batch_fill_us']:.1f} "
            f"| {row['batch_accept_us']:.1f} | {row['only_allowed_steps']}/{row['steps']} "
            f"| {'-' if first is None else repr(first[1])} |"
        )


if __name__ == "__main__":
    raise SystemExit(main())
