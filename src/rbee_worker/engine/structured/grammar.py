"""Structured output: grammars that constrain a request's tokens (a JSON schema, or any JSON object), compiled by
xgrammar, the grammar engine vLLM and SGLang use by default, against the model's tokenizer. xgrammar fills a
constrained row's mask several times faster than llguidance, vLLM's other engine, which a step of many constrained
rows needs; llguidance compiles faster, which the cache below hides (bench/grammar_engines.py measures both).

- `GrammarSpec` says what a request asks for; `Grammars.compile` compiles it in a child process
  (engine/structured/grammar_processes.py: one past its time limit is stopped), waited for on a small thread pool of its
  own, never on the engine thread or an event loop, and keeps the result by spec (least recently used out past
  CACHE_BYTES), so the same schema compiles once. xgrammar is imported at the first compilation: a worker that never
  constrains a request does not load it.
- A request's `Matcher` follows its tokens: before each of its tokens is sampled, it writes the tokens its grammar
  allows into the request's row of a bitmask of the sampler's layout (SamplerState.set_mask: int32 words,
  ceil(vocab / 32) per row, bit b of word j for token 32 * j + b, which is xgrammar's own layout), and it accepts
  each token chosen.
- A reasoning model's request (chat/reasoning.py) follows its grammar only after its reasoning, as vLLM's structured
  output with a reasoning parser does: while the reasoning runs the matcher is dormant and masks nothing, and the
  grammar starts at the token after the end tag. The reasoning runs from the first token when the prompt opens it;
  otherwise the first token may be the start tag, besides what the grammar allows.

The text the grammar reads must be the text the caller gets. The detokenizer skips special tokens, so every special
token but the end-of-sequence ones is left out of the grammar's vocabulary (an empty token, which xgrammar never
allows); the end-of-sequence tokens are the grammar's stop tokens, allowed once the grammar is complete, and only
then. JSON is written on one line with xgrammar's separators (`{"a": 1, "b": [2, 3]}`): free whitespace would let a
model run on in newlines and spaces until max_tokens.
"""

import collections
import functools
import json
import re
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import torch
from transformers import PreTrainedTokenizerBase

from rbee_worker.chat.reasoning import ReasoningFormat, opens_reasoning_ids
from rbee_worker.engine.structured.grammar_processes import CompileFailed, CompilerProcesses, CompileTimeout

if TYPE_CHECKING:
    import xgrammar

CACHE_BYTES = 256 << 20  # compiled grammars kept, by xgrammar's measure of their size
COMPILE_PROCESSES = 2  # grammars compiled at once, each by a process of its own on one thread
# xgrammar's error messages start with a time and a source location: "[18:29:56] /project/cpp/x.cc:5082: ".
_SOURCE_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")


class GrammarRejected(RuntimeError):
    """A constrained request's token that its grammar does not allow: a bug, since the row's mask rules it out."""


class GrammarError(ValueError):
    """A grammar that cannot be compiled: a malformed or unsupported schema, or one no text satisfies. The message
    says why, for the request's caller."""


@dataclass(frozen=True)
class GrammarSpec:
    """What a request's output must follow: any JSON object (`json_object`), or the JSON schema `text` (compact
    JSON, keys in their given order, which is the order the output writes an object's properties in)."""

    kind: Literal["json_schema", "json_object"]
    text: str = ""

    @staticmethod
    def json_schema(schema: dict[str, Any]) -> "GrammarSpec":
        if not isinstance(schema, dict):
            raise GrammarError("a JSON schema must be a JSON object")
        return GrammarSpec("json_schema", json.dumps(schema, ensure_ascii=False, separators=(",", ":")))

    @staticmethod
    def json_object() -> "GrammarSpec":
        return GrammarSpec("json_object")


@dataclass(frozen=True)
class CompiledGrammar:
    """A spec compiled for this model's tokenizer (a Request carries it)."""

    spec: GrammarSpec
    handle: "xgrammar.CompiledGrammar"
    stop_ids: frozenset[int]  # the grammar's stop tokens: accepting one ends it


@dataclass
class GrammarStats:
    """What the metrics report: compilations and their seconds, lookups served by the cache, and the masks filled
    (per constrained token) and their seconds."""

    compilations: int = 0
    compile_seconds: float = 0.0
    cache_hits: int = 0
    masks: int = 0
    mask_seconds: float = 0.0


class Matcher:
    """One request's place in its grammar (made for each request; used on the engine thread only, or on
    accept_tokens' threads while it waits).

    The engine thread asks a matcher several things each step; each xgrammar call releases the GIL, and with other
    threads (the HTTP server's) waiting for it, getting it back can take far longer than the call. So the matcher
    keeps what it can know itself: it has ended when its grammar accepted a stop token (xgrammar's is_terminated), and
    a step's accepts and fills are one xgrammar call for many rows (accept_tokens, fill_masks).

    With `reasoning` (a format with both tags' token ids), the grammar applies after the reasoning: the matcher is
    dormant from the start when `opened` (the prompt opens the reasoning), and otherwise its first token may be the
    start tag, which makes it dormant; a dormant matcher allows every token and wakes after the end tag."""

    def __init__(
        self,
        grammar: CompiledGrammar,
        stats: GrammarStats,
        reasoning: ReasoningFormat | None = None,
        opened: bool = False,
    ) -> None:
        import xgrammar

        self._matcher = xgrammar.GrammarMatcher(grammar.handle)
        self._stats = stats
        self._stop_ids = grammar.stop_ids
        self._stuck = False  # the latest fill allowed no token
        self._ended = False  # the grammar accepted a stop token
        tags = reasoning is not None and reasoning.start_id is not None and reasoning.end_id is not None
        self._start_id = reasoning.start_id if tags else None
        self._end_id = reasoning.end_id if tags else None
        self._dormant = tags and opened  # in the reasoning: every token allowed, the grammar waits
        self._may_open = tags and not opened  # the next token may be the start tag

    def fill(self, bitmask: torch.Tensor, row: int) -> bool:
        """Write the tokens the grammar allows next into row `row` of `bitmask` (int32, on the host). Returns whether
        the row's next draw is masked: False while the matcher is dormant (every token allowed, nothing written)."""
        return fill_masks([self], [row], bitmask)[0]

    def _fills(self) -> bool:
        """Whether a fill writes a mask: not while dormant, nor once terminated (nothing follows: no mask to fill)."""
        return not self._dormant and not self._ended

    def _filled(self, words: np.ndarray, seconds: float) -> None:
        """After xgrammar has written the row (`words`, a view of it): whether it allows nothing, the start tag where
        it may come. numpy, not torch: a torch call for each row costs more than the check itself."""
        self._stuck = not words.any()
        if self._may_open:
            word, bit = divmod(self._start_id, 32)
            words[word] |= np.int32((1 << bit) - (1 << 32 if bit == 31 else 0))  # bit 31 is int32's sign
        self._stats.masks += 1
        self._stats.mask_seconds += seconds

    def accept(self, token: int) -> bool:
        """Advance past a chosen token; False when the grammar does not allow it (the matcher is unchanged). A dormant
        matcher takes any token, and wakes at the end tag; the start tag as the first token makes it dormant."""
        outside = self.accept_outside_grammar(token)
        return outside if outside is not None else self._took(token, self._matcher.accept_token(token))

    def accept_outside_grammar(self, token: int) -> bool | None:
        """accept's answer where the grammar has no say (the reasoning's tokens, the start tag); None: the grammar's
        accept decides (then `_took`)."""
        if self._dormant:
            self._dormant = token != self._end_id
            return True
        if self._may_open and token == self._start_id:
            self._dormant = True
            self._may_open = False
            return True
        return None

    def _took(self, token: int, accepted: bool) -> bool:
        """After the grammar's accept of `token`."""
        if accepted:
            self._may_open = False
            self._ended = token in self._stop_ids
        return accepted

    @property
    def terminated(self) -> bool:
        """Whether nothing may follow: the grammar has accepted a stop token, or the latest fill allowed no token (the
        grammar cannot continue)."""
        return self._stuck or self._ended


def fill_masks(matchers: Sequence[Matcher], rows: Sequence[int], bitmask: torch.Tensor) -> list[bool]:
    """Matcher.fill for several rows at once: xgrammar fills the rows of a batch on several threads (its
    BatchGrammarMatcher), which a step of many constrained rows needs, as one row's fill over a large vocabulary takes
    about as long as a small model's decode step. Returns, for each matcher, whether its row's next draw is masked."""
    active = [(matcher, row) for matcher, row in zip(matchers, rows, strict=True) if matcher._fills()]
    if active:
        started = time.perf_counter()
        if len(active) == 1:
            active[0][0]._matcher.fill_next_token_bitmask(bitmask, active[0][1])
        else:
            handles = [matcher._matcher for matcher, _ in active]
            _batch_matcher().batch_fill_next_token_bitmask(handles, bitmask, [row for _, row in active])
        seconds = (time.perf_counter() - started) / len(active)
        words = bitmask.numpy()  # the same memory
        for matcher, row in active:
            matcher._filled(words[row], seconds)
    return [not matcher._dormant for matcher in matchers]


def accept_tokens(matchers: Sequence[Matcher], tokens: Sequence[int]) -> list[bool | Exception]:
    """Matcher.accept for several matchers, each with its token: what each accept returns, or the exception it raised.
    A row's accept over a JSON schema takes tens of microseconds of xgrammar's parser; the rows that their grammars
    decide go to xgrammar in one call (its batch_accept_token), on the engine thread. One call, not shares on several
    threads: each xgrammar call releases the GIL, and a thread that wants it back waits behind the HTTP server's event
    loop, which holds it for most of a step when many streams are served (bench/results/README.md); should that call
    raise, one row at a time, so that a failure is its row's alone."""
    outside = [matcher.accept_outside_grammar(token) for matcher, token in zip(matchers, tokens, strict=True)]
    results: list[bool | Exception] = [result or False for result in outside]
    inside = [i for i, result in enumerate(outside) if result is None]
    if not inside:
        return results  # every step of unconstrained rows: xgrammar stays unloaded
    import xgrammar

    handles = [matchers[i]._matcher for i in inside]
    accepted: list[bool | Exception]
    try:
        accepted = list(xgrammar.BatchGrammarMatcher.batch_accept_token(handles, [tokens[i] for i in inside]))
    except Exception:
        accepted = []
        for i, handle in zip(inside, handles, strict=True):
            try:
                accepted.append(handle.accept_token(tokens[i]))
            except Exception as exc:
                accepted.append(exc)
    for i, result in zip(inside, accepted, strict=True):
        results[i] = result if isinstance(result, Exception) else matchers[i]._took(tokens[i], result)
    return results


@functools.cache
def _batch_matcher() -> "xgrammar.BatchGrammarMatcher":
    """xgrammar's batch filler (made once: it owns a thread pool of half the machine's hardware threads)."""
    import xgrammar

    return xgrammar.BatchGrammarMatcher()


class Grammars:
    """Compiles grammars for one model's tokenizer, off the caller's thread, and keeps them by spec."""

    def __init__(
        self, tokenizer: PreTrainedTokenizerBase, vocab_size: int, stop_ids: frozenset[int], timeout_s: float
    ) -> None:
        self._tokenizer, self._vocab_size, self._stop_ids = tokenizer, vocab_size, stop_ids
        self._timeout_s = timeout_s  # a compilation's limit
        self._executor = ThreadPoolExecutor(COMPILE_PROCESSES, thread_name_prefix="rbee-grammar")
        self._lock = threading.Lock()  # the cache and the stats (held briefly: callers include the event loop)
        self._compiler_lock = threading.Lock()
        # Made by the first compilation: xgrammar's view of the tokenizer, and the processes that compile against it.
        self._compiler: tuple[xgrammar.TokenizerInfo, CompilerProcesses] | None = None
        self._cache: collections.OrderedDict[GrammarSpec, Future[CompiledGrammar]] = collections.OrderedDict()
        self._sizes: dict[GrammarSpec, int] = {}  # of the compiled entries of _cache
        self.stats = GrammarStats()

    def compile(self, spec: GrammarSpec) -> "Future[CompiledGrammar]":
        """The compiled grammar, at once from the cache or later from the pool; the future's exception is a
        GrammarError for a spec that does not compile."""
        with self._lock:
            future = self._cache.get(spec)
            if future is not None:
                self._cache.move_to_end(spec)
                self.stats.cache_hits += 1
                return future
            future = self._cache[spec] = self._executor.submit(self._compile, spec)
            return future

    def matcher(
        self, grammar: CompiledGrammar, reasoning: ReasoningFormat | None = None, prompt_ids: Sequence[int] = ()
    ) -> Matcher:
        """A request's matcher; with a reasoning format, the grammar applies after the reasoning (see Matcher), which
        the prompt's ids may open."""
        opened = reasoning is not None and opens_reasoning_ids(reasoning, prompt_ids)
        return Matcher(grammar, self.stats, reasoning, opened)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
        with self._compiler_lock:
            if self._compiler is not None:
                self._compiler[1].close()

    def _compile(self, spec: GrammarSpec) -> CompiledGrammar:
        started = time.perf_counter()
        try:
            handle = self._compile_spec(spec)
            grammar = CompiledGrammar(spec, handle, frozenset(handle.tokenizer_info.stop_token_ids))
            first = Matcher(grammar, GrammarStats())
            first.fill(host_bitmask(1, self._vocab_size), 0)
            if first.terminated:
                raise GrammarError("the JSON schema admits no value")
        except BaseException:
            with self._lock:
                self._cache.pop(spec, None)  # a failure is not kept: the same spec is compiled (and refused) again
            raise
        size = grammar.handle.memory_size_bytes
        with self._lock:
            self.stats.compilations += 1
            self.stats.compile_seconds += time.perf_counter() - started
            if spec in self._cache:
                self._sizes[spec] = size
                self._evict()
        return grammar

    def _compile_spec(self, spec: GrammarSpec) -> "xgrammar.CompiledGrammar":
        import xgrammar

        info, processes = self._compiler_once()
        schema = spec.text if spec.kind == "json_schema" else '{"type": "object"}'
        try:
            compiled = processes.compile(schema, self._timeout_s)
        except CompileTimeout as exc:
            raise GrammarError(f"the JSON schema {exc}") from None
        except CompileFailed as exc:
            reason = _SOURCE_PREFIX.sub("", str(exc).strip().splitlines()[0])
            raise GrammarError(f"the JSON schema cannot be compiled: {reason}") from None
        return xgrammar.CompiledGrammar.deserialize_json(compiled, info)

    def _compiler_once(self) -> "tuple[xgrammar.TokenizerInfo, CompilerProcesses]":
        with self._compiler_lock:
            if self._compiler is None:
                info = tokenizer_info(self._tokenizer, self._vocab_size, self._stop_ids)
                self._compiler = info, CompilerProcesses(info.serialize_json(), COMPILE_PROCESSES)
            return self._compiler

    def _evict(self) -> None:
        """Least recently used compiled grammars out until the rest fit CACHE_BYTES (called under the lock)."""
        while sum(self._sizes.values()) > CACHE_BYTES and len(self._sizes) > 1:
            oldest = next(spec for spec in self._cache if spec in self._sizes)
            del self._cache[oldest], self._sizes[oldest]


def tokenizer_info(
    tokenizer: PreTrainedTokenizerBase, vocab_size: int, stop_ids: frozenset[int]
) -> "xgrammar.TokenizerInfo":
    """xgrammar's view of the tokenizer, `vocab_size` tokens wide (the logits' width: ids past the tokenizer's are
    never allowed): its special tokens but `stop_ids` emptied (never allowed, see the module docstring), `stop_ids`
    the stop tokens, and every token whose text holds a control character (U+0000-U+001F) emptied too. The JSON these
    grammars write has no whitespace but spaces and such characters never appear raw in it, yet xgrammar 0.2.9
    admits them inside a string with a length bound (mlc-ai/xgrammar#800), which would make text no JSON parser
    reads."""
    import xgrammar

    stops = sorted(stop_ids) or None  # None: xgrammar finds the tokenizer's own
    detected = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stops)
    special = {i for i, token in tokenizer.added_tokens_decoder.items() if token.special}
    hidden = (special | set(tokenizer.all_special_ids)) - stop_ids
    ids = [(token, i) for token, i in tokenizer.get_vocab().items() if i < vocab_size and i not in hidden]
    texts = tokenizer.batch_decode([[i] for _, i in ids])
    vocab = [""] * vocab_size
    for (token, i), text in zip(ids, texts, strict=True):
        if not any(character < " " for character in text):
            vocab[i] = token
    return xgrammar.TokenizerInfo(
        vocab,
        detected.vocab_type,
        vocab_size=vocab_size,
        stop_token_ids=stops,
        add_prefix_space=detected.add_prefix_space,
    )


def host_bitmask(rows: int, vocab_size: int, pin: bool = False) -> torch.Tensor:
    """A bitmask of the sampler's layout in host memory (`pin`: pinned, for copies to a GPU that do not wait), every
    token allowed."""
    return torch.full((rows, (vocab_size + 31) // 32), -1, dtype=torch.int32, pin_memory=pin)
