"""The engine: one scheduler thread owns the model and every KV cache; callers submit requests and receive events.

Each step of the loop is schedule -> forward -> postprocess (sample, detokenize, stop checks, emit events). Requests
run concurrently: every active sequence advances by one forward per round, so a new request starts between two
tokens of the others and none waits for another to finish. Each forward covers one sequence, which also makes every
request's tokens independent of what else runs (batch invariance): `--deterministic` is therefore met by
construction today; batching several sequences into one forward (the performance issue) will keep a batch-of-one
path for that flag.

At most `max_batch` requests advance at a time; admitted requests beyond that wait in arrival order, and at most
`max_queue` may wait: a request beyond both limits is refused at once (EngineBusy) rather than queued without end.
"""

import asyncio
import inspect
import itertools
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

import torch
from transformers import DynamicCache

from rbee_worker.engine.detokenizer import Detokenizer
from rbee_worker.engine.sampling import Sampler, random_seed
from rbee_worker.engine.types import End, Error, ErrorCode, Event, Request, Started, StopReason, Token, TokenLogprob
from rbee_worker.models.loaded import LoadedModel

log = logging.getLogger(__name__)

Sink = Callable[[Event], None]


class RequestError(ValueError):
    """A request the engine refuses before generating (the message says why)."""


class EngineObserver(Protocol):
    """Told about every request's timing on the engine thread (the worker's metrics); must be quick."""

    def first_token(self, seconds: float) -> None:
        """From submission to the first sampled token."""

    def next_token(self, seconds: float) -> None:
        """Between two sampled tokens of one request (the end-of-sequence token included)."""

    def finished(self, request: Request, terminal: End | Error, seconds: float) -> None:
        """The request ended, `seconds` after its submission."""


class _NoObserver:
    def first_token(self, seconds: float) -> None:
        pass

    def next_token(self, seconds: float) -> None:
        pass

    def finished(self, request: Request, terminal: End | Error, seconds: float) -> None:
        pass


class DuplicateRequest(RuntimeError):
    """A request with this id is already in flight."""


class EngineBusy(RuntimeError):
    """Every running slot and every queue place is taken; the caller should retry later."""

    def __init__(self, max_batch: int, max_queue: int, in_flight: int) -> None:
        super().__init__(f"all {max_batch} slots and {max_queue} queue places are taken; retry shortly")
        self.max_batch, self.max_queue, self.in_flight = max_batch, max_queue, in_flight


@dataclass
class _Sequence:
    request: Request
    sink: Sink
    seed: int
    sampler: Sampler
    detokenizer: Detokenizer
    submitted_at: float
    cache: DynamicCache | None = None  # None until the prompt has been prefilled
    output_ids: list[int] = field(default_factory=list)
    pieces: int = 0
    first_token_at: float | None = None
    last_token_at: float | None = None
    cancelled: bool = False

    def send(self, event: Event) -> None:
        """Deliver an event; a consumer that is gone (its event loop closed, say) cancels the request instead of
        taking the engine thread down."""
        try:
            self.sink(event)
        except Exception:
            log.warning("could not deliver an event of request %s; cancelling it", self.request.request_id)
            self.cancelled = True


class Engine:
    """Runs `load` and then every forward pass on its own thread.

    Loading happens on the engine thread too because the thread that first runs torch's CPU kernels keeps them
    fast: measured here, decoding on a thread other than the one that loaded the model ran at half the speed
    (20 vs 44 tok/s, demo model, fp16, 2 cores), while loading and decoding on one thread matched the main thread.
    """

    def __init__(
        self,
        load: Callable[[], LoadedModel],
        *,
        deterministic: bool = False,
        max_batch: int = 16,
        max_queue: int = 64,
        observer: EngineObserver | None = None,
    ) -> None:
        if max_batch < 1 or max_queue < 0:
            raise ValueError("max_batch must be at least 1 and max_queue at least 0")
        self.deterministic = deterministic
        self.max_batch, self.max_queue = max_batch, max_queue
        self._observer = observer or _NoObserver()
        self._load = load
        self._loaded: LoadedModel | None = None
        self._load_error: BaseException | None = None
        self._ready = threading.Event()
        self._inbox: queue.SimpleQueue[_Sequence | str | None] = queue.SimpleQueue()
        # Admitted requests in arrival order: the first max_batch run, the others wait for a slot.
        self._active: dict[str, _Sequence] = {}
        self._in_flight: set[str] = set()  # ids submitted and not yet ended: inbox, running and waiting requests
        self._in_flight_lock = threading.Lock()
        self._last_progress = time.monotonic()  # the end of the latest step (or of the latest idle wait)
        self._kv_bytes = 0
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rbee-engine", daemon=True)
        self._thread.start()

    @property
    def is_loaded(self) -> bool:
        """True once the model is loaded and the engine serves requests (never blocks)."""
        return self._loaded is not None and not self._closed.is_set()

    @property
    def load_finished(self) -> bool:
        """True once loading has ended, loaded or failed (never blocks)."""
        return self._ready.is_set()

    @property
    def loaded(self) -> LoadedModel:
        """The model, once loaded (blocks until then); raises what loading raised."""
        self._ready.wait()
        if self._loaded is None:
            raise self._load_error or RuntimeError("the engine was closed before the model loaded")
        return self._loaded

    # -- the caller's side (any thread) ------------------------------------------------------------------------

    def tokenize(self, text: str, add_special_tokens: bool = True) -> tuple[int, ...]:
        """Token ids of a raw prompt, exactly as the model's tokenizer makes them (BOS as its settings say)."""
        return tuple(self.loaded.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])

    def chat_prompt(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The prompt text the model's chat template renders (transformers' apply_chat_template), by default ending
        with the assistant turn's header. Raises ValueError when the model has no template, or a template error."""
        return self.loaded.tokenizer.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tokenize=False
        )

    def tokenize_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> tuple[int, ...]:
        # The template writes BOS and the other special tokens itself, so none are added again.
        prompt = self.chat_prompt(messages, add_generation_prompt)
        return tuple(self.loaded.tokenizer(prompt, add_special_tokens=False)["input_ids"])

    def detokenize(self, token_ids: tuple[int, ...]) -> str:
        return self.loaded.tokenizer.decode(token_ids)

    def token_text(self, token_id: int) -> str:
        """One token's own text (a partial UTF-8 character decodes to U+FFFD)."""
        return self.loaded.tokenizer.decode([token_id])

    @property
    def vocab_size(self) -> int:
        return len(self.loaded.tokenizer)

    def validate(self, request: Request) -> None:
        """Raise RequestError for a request that cannot run on this model."""
        context = self.loaded.info.context_length
        if not request.prompt_ids:
            raise RequestError("the prompt is empty after tokenization")
        if request.max_tokens < 1:
            raise RequestError("max_tokens must be at least 1")
        if len(request.prompt_ids) + request.max_tokens > context:
            raise RequestError(
                f"prompt ({len(request.prompt_ids)} tokens) + max_tokens ({request.max_tokens}) exceeds the model's "
                f"context of {context} tokens; shorten the prompt or lower max_tokens"
            )
        if any(not s for s in request.stop):
            raise RequestError("stop strings must be non-empty")

    def submit(self, request: Request, sink: Sink) -> None:
        """Queue a request; `sink` gets Started, Token*, then exactly one End or Error, from the engine thread.

        Raises DuplicateRequest when a request with the same id is in flight and EngineBusy when the running slots
        and the queue are full, both before anything is sent.
        """
        try:
            if self._closed.is_set():
                raise RequestError("the engine is shut down")
            self.validate(request)
            seed = random_seed() if request.seed is None else request.seed
            sampler = Sampler(request.sampling, seed, request.prompt_ids)  # rejects a seed outside 0..2**64-1
        except (RequestError, ValueError) as exc:
            sink(Error(request.request_id, ErrorCode.INVALID_REQUEST, str(exc)))
            return
        sequence = _Sequence(
            request=request,
            sink=sink,
            seed=seed,
            sampler=sampler,
            detokenizer=Detokenizer(self.loaded.tokenizer.backend_tokenizer, request.stop),
            submitted_at=time.perf_counter(),
        )
        with self._in_flight_lock:
            if request.request_id in self._in_flight:
                raise DuplicateRequest(f"request {request.request_id} is already running")
            if len(self._in_flight) >= self.max_batch + self.max_queue:
                raise EngineBusy(self.max_batch, self.max_queue, len(self._in_flight))
            self._in_flight.add(request.request_id)
        self._inbox.put(sequence)

    def stream(self, request: Request) -> Iterator[Event]:
        """Blocking iterator over a request's events; leaving it early cancels the request."""
        events: queue.SimpleQueue[Event] = queue.SimpleQueue()
        self.submit(request, events.put)
        finished = False
        try:
            while not finished:
                event = events.get()
                finished = isinstance(event, End | Error)
                yield event
        finally:
            if not finished:
                self.cancel(request.request_id)

    def astream(self, request: Request) -> AsyncIterator[Event]:
        """Submit now (raising EngineBusy at once) and return the request's events on the running event loop;
        leaving the iterator early (or cancelling its task) cancels the request.

        Only queues cross threads here: the event loop never runs model code (see the class docstring).
        """
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[Event] = asyncio.Queue()
        self.submit(request, lambda event: loop.call_soon_threadsafe(events.put_nowait, event))
        return self._receive(request.request_id, events)

    async def _receive(self, request_id: str, events: "asyncio.Queue[Event]") -> AsyncIterator[Event]:
        finished = False
        try:
            while not finished:
                event = await events.get()
                finished = isinstance(event, End | Error)
                yield event
        finally:
            if not finished:
                self.cancel(request_id)

    def cancel(self, request_id: str) -> None:
        """Stop a request between two steps; it ends with stop reason CANCELLED. Unknown ids are ignored."""
        self._inbox.put(request_id)

    def cancel_all(self) -> None:
        """Cancel every request in flight (each ends CANCELLED)."""
        with self._in_flight_lock:
            ids = list(self._in_flight)
        for request_id in ids:
            self.cancel(request_id)

    def close(self) -> None:
        """Cancel everything and stop the scheduler thread (after the load, if it still runs: see LoadProgress.cancel
        for cutting that short)."""
        self._closed.set()
        self._inbox.put(None)
        self._thread.join()
        # A request that raced with close never reached the loop: end it rather than leave its caller waiting.
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, _Sequence):
                self._retire(item, Error(item.request.request_id, ErrorCode.CANCELLED, "the engine shut down"))

    @property
    def running_requests(self) -> int:
        """Requests holding one of the max_batch slots (the others in flight wait for one)."""
        return min(len(self._active), self.max_batch)

    @property
    def in_flight(self) -> int:
        """Requests submitted and not yet ended: running, waiting for a slot, or not yet seen by the engine."""
        return len(self._in_flight)

    def seconds_without_progress(self) -> float:
        """How long the engine has had work and finished no step; 0 when idle. A dead engine thread never
        progresses again: infinity."""
        if not self._thread.is_alive():
            return float("inf")
        if not self._in_flight:
            return 0.0
        return max(0.0, time.monotonic() - self._last_progress)

    def kv_cache_usage(self) -> float:
        """KV cache in use as a fraction of what max_batch requests at the full context would hold; 0 before the
        model is loaded."""
        if not self.is_loaded:
            return 0.0
        info = self.loaded.info
        budget = self.max_batch * info.context_length * kv_bytes_per_token(self.loaded.model.config, info.dtype)
        return self._kv_bytes / budget if budget else 0.0

    def memory_bytes(self) -> int:
        """Measured device memory in use: weights plus the KV caches of the active requests."""
        info = self.loaded.info
        if info.device.type == "cuda":
            return int(torch.cuda.memory_allocated(info.device))
        return info.weight_bytes + self._kv_bytes

    # -- the engine thread ------------------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._loaded = self._load()
        except BaseException as exc:  # handed to the caller through `loaded`
            self._load_error = exc
            return
        finally:
            self._ready.set()
        self._model = self._loaded.model
        self._eos = self._loaded.info.eos_token_ids
        # transformers renamed forward's `past_key_values` to `cache` (5.2x); the GPU machines still run 5.17.
        parameters = inspect.signature(self._model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in parameters else "past_key_values"
        with torch.inference_mode():
            while self._admit(block=not self._active):
                for sequence in list(itertools.islice(self._active.values(), self.max_batch)):
                    self._advance(sequence)
                    self._last_progress = time.monotonic()
                self._kv_bytes = sum(_cache_bytes(s.cache) for s in self._active.values())
            for sequence in list(self._active.values()):
                self._finish(sequence, StopReason.CANCELLED)

    def _admit(self, block: bool) -> bool:
        """Take new requests and cancellations from the inbox; False once the engine is closing."""
        while True:
            try:
                item = self._inbox.get(block=block)
            except queue.Empty:
                return True
            if block:  # the engine was idle until now: the wait was not a stall
                self._last_progress = time.monotonic()
            block = False
            if item is None:
                return False
            if isinstance(item, str):
                # Ended here rather than at its next step: its KV cache is freed and its id can be reused at once.
                if sequence := self._active.get(item):
                    self._finish(sequence, StopReason.CANCELLED)
            else:
                self._active[item.request.request_id] = item
                item.send(Started(item.request.request_id, len(item.request.prompt_ids), item.seed))

    def _advance(self, sequence: _Sequence) -> None:
        if sequence.cancelled:
            self._finish(sequence, StopReason.CANCELLED)
            return
        try:
            logits = self._forward(sequence)
            token = sequence.sampler(logits, sequence.output_ids)
            logprob = None if sequence.request.logprobs is None else _logprob(logits, token, sequence.request.logprobs)
        except torch.OutOfMemoryError:
            self._fail(
                sequence, ErrorCode.VRAM_OOM, "out of device memory during generation; retry with a shorter request"
            )
            return
        except Exception as exc:  # a failed forward must end this request, never the engine thread
            log.exception("inference failed for request %s", sequence.request.request_id)
            self._fail(sequence, ErrorCode.INFERENCE_FAILED, f"inference failed: {exc}")
            return
        self._accept(sequence, token, logprob)

    def _forward(self, sequence: _Sequence) -> torch.Tensor:
        """Logits for the next token: a prefill over the whole prompt first, then one token at a time."""
        if sequence.cache is None:
            sequence.cache = DynamicCache(config=self._model.config)
            ids = sequence.request.prompt_ids
        else:
            ids = sequence.output_ids[-1:]
        input_ids = torch.tensor([ids], device=self._model.device)
        output = self._model(
            input_ids=input_ids, use_cache=True, logits_to_keep=1, **{self._cache_kwarg: sequence.cache}
        )
        return output.logits[0, -1]

    def _accept(self, sequence: _Sequence, token: int, logprob: TokenLogprob | None) -> None:
        now = time.perf_counter()
        if sequence.last_token_at is None:
            sequence.first_token_at = now
            self._observer.first_token(now - sequence.submitted_at)
        else:
            self._observer.next_token(now - sequence.last_token_at)
        sequence.last_token_at = now
        if token in self._eos:
            self._finish(sequence, StopReason.EOS)
            return
        sequence.output_ids.append(token)
        text = sequence.detokenizer.add_token(token)
        self._emit_piece(sequence, text, (token,), () if logprob is None else (logprob,))
        if sequence.detokenizer.stop_matched is not None:
            self._finish(sequence, StopReason.STOP_SEQUENCE)
        elif len(sequence.output_ids) >= sequence.request.max_tokens:
            self._finish(sequence, StopReason.MAX_TOKENS)

    def _emit_piece(
        self, sequence: _Sequence, text: str, token_ids: tuple[int, ...], logprobs: tuple[TokenLogprob, ...] = ()
    ) -> None:
        sequence.send(Token(sequence.request.request_id, text, token_ids, sequence.pieces, logprobs))
        sequence.pieces += 1

    def _finish(self, sequence: _Sequence, reason: StopReason) -> None:
        if reason is not StopReason.CANCELLED and (rest := sequence.detokenizer.finish()):
            self._emit_piece(sequence, rest, ())
        now = time.perf_counter()
        first = sequence.first_token_at or now
        self._retire(
            sequence,
            End(
                request_id=sequence.request.request_id,
                stop_reason=reason,
                prompt_tokens=len(sequence.request.prompt_ids),
                tokens_out=len(sequence.output_ids),
                seed=sequence.seed,
                stop_sequence=sequence.detokenizer.stop_matched,
                time_to_first_token_s=first - sequence.submitted_at,
                decode_time_s=now - first,
                kv_cache_bytes=_cache_bytes(sequence.cache),
            ),
        )

    def _fail(self, sequence: _Sequence, code: ErrorCode, message: str) -> None:
        self._retire(sequence, Error(sequence.request.request_id, code, message))

    def _retire(self, sequence: _Sequence, terminal: End | Error) -> None:
        """Free the request's slot and KV cache, then send its one terminal event."""
        if self._active.get(sequence.request.request_id) is sequence:
            del self._active[sequence.request.request_id]
        sequence.cache = None
        self._kv_bytes = sum(_cache_bytes(s.cache) for s in self._active.values())  # fresh before the caller hears
        with self._in_flight_lock:
            self._in_flight.discard(sequence.request.request_id)
        sequence.send(terminal)
        self._observer.finished(sequence.request, terminal, time.perf_counter() - sequence.submitted_at)
        _log_finished(sequence.request, terminal)


def _log_finished(request: Request, terminal: End | Error) -> None:
    """The one log line per finished request (CONTRACT.md §5)."""
    fields: dict[str, object] = {"job_id": request.request_id, "correlation_id": request.correlation_id}
    if isinstance(terminal, Error):
        fields |= {"prompt_tokens": len(request.prompt_ids), "error": terminal.code.value, "message": terminal.message}
        log.log(
            logging.INFO if terminal.code is ErrorCode.CANCELLED else logging.WARNING,
            "job failed",
            extra={"fields": fields},
        )
        return
    decode_rate = (terminal.tokens_out - 1) / terminal.decode_time_s if terminal.decode_time_s > 0 else 0.0
    fields |= {
        "prompt_tokens": terminal.prompt_tokens,
        "tokens_out": terminal.tokens_out,
        "ttft_ms": round(terminal.time_to_first_token_s * 1000, 1),
        "tokens_per_s": round(max(decode_rate, 0.0), 1),
        "stop_reason": terminal.stop_reason.value,
    }
    log.info("job finished", extra={"fields": fields})


def _logprob(logits: torch.Tensor, token: int, top: int) -> TokenLogprob:
    """The chosen token's log-probability and the `top` most likely, from the raw logits (as vLLM's default)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    values, ids = torch.topk(logprobs, top) if top else (logprobs[:0], logprobs[:0].long())
    pairs = tuple(zip(ids.tolist(), values.tolist(), strict=True))
    return TokenLogprob(token, float(logprobs[token]), pairs)


def kv_bytes_per_token(config, dtype: torch.dtype) -> int:
    """Bytes of keys and values that one token of context takes over all layers, from the model's config."""
    text = config.get_text_config()
    heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    return 2 * text.num_hidden_layers * heads * head_dim * dtype.itemsize


def _cache_bytes(cache: DynamicCache | None) -> int:
    if cache is None:
        return 0
    return sum(
        tensor.nbytes
        for layer in cache.layers
        for tensor in (layer.keys, layer.values)
        if isinstance(tensor, torch.Tensor)
    )
