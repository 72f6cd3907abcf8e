"""The engine: one scheduler thread owns the model and the KV cache; callers submit requests and receive events.

Each round of the loop: admit requests and cancellations; give prefill chunks (up to `prefill_chunk` prompt tokens
in all, oldest request first) to the sequences still reading their prompt; then one decode step for every sequence
that has its prompt cached, batched into a single forward pass (continuous batching: a new request joins the batch
as soon as its prompt is in, a finished or cancelled one leaves it at once). A long prompt therefore delays the
others' next token by at most one chunk.

At most `max_batch` requests hold a KV slot and run; admitted requests beyond that wait in arrival order, and at
most `max_queue` may wait: a request beyond both limits is refused at once (EngineBusy) rather than queued without
end.

`deterministic` (batch invariance): a request's tokens must not depend on what else runs. Batched matrix products
reduce in an order that depends on the batch size, so in that mode every sequence decodes in a forward of its own,
and prefill chunks always split a prompt at the same offsets whatever else runs.
"""

import asyncio
import contextlib
import dataclasses
import functools
import inspect
import itertools
import logging
import math
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import psutil
import torch

from rbee_worker.devices import tensor_bytes
from rbee_worker.engine.attention import use_engine_attention
from rbee_worker.engine.compiled import compile_model, uncompile_model
from rbee_worker.engine.config import EngineConfig
from rbee_worker.engine.cpu_linear import can_pack, pack_linears, packed_bytes
from rbee_worker.engine.cuda_graphs import DecodeGraphs, LaunchedStep, PrefillGraphs
from rbee_worker.engine.detokenizer import Detokenizer
from rbee_worker.engine.kv_cache import SlotCache, decode_mask, kv_bytes_per_token, prefill_mask
from rbee_worker.engine.sampling import Sampler, greedy_rows, random_seed
from rbee_worker.engine.types import End, Error, ErrorCode, Event, Request, Started, StopReason, Token, TokenLogprob
from rbee_worker.errors import ModelLoadError
from rbee_worker.models.loaded import LoadedModel
from rbee_worker.models.merged_linear import merge_projections

log = logging.getLogger(__name__)

GRAPH_WARM_SPAN = 2048  # decode graphs captured before ready: every batch bucket up to this attention span
MIN_SLOT_TOKENS = 64  # a KV slot shorter than this cannot hold a useful request
GPU_KV_SHARE = 0.9  # of the device memory free after loading
ACTIVATION_RESERVE_BYTES = 1 << 30  # left free on a GPU for activations and logits
CPU_KV_SHARE = 0.5  # of the host memory available after loading

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
    slot: int | None = None  # its row in the KV cache, once it runs
    cached: int = 0  # tokens whose keys and values are in its slot: the prompt first, then all but the last output
    output_ids: list[int] = field(default_factory=list)
    pieces: int = 0
    first_token_at: float | None = None
    last_token_at: float | None = None
    cancelled: bool = False
    launched: int = 0  # decode steps launched on a GPU whose tokens the host has not taken yet (see _decode_graphs)

    def send(self, event: Event) -> None:
        """Deliver an event; a consumer that is gone (its event loop closed, say) cancels the request instead of
        taking the engine thread down."""
        try:
            self.sink(event)
        except Exception:
            log.warning("could not deliver an event of request %s; cancelling it", self.request.request_id)
            self.cancelled = True


@dataclass
class _Launched:
    """A decode step launched for these sequences (each on the row of its slot)."""

    sequences: list[_Sequence]
    step: LaunchedStep


def _plain(sequence: _Sequence) -> bool:
    """Whether the sequence's next token is the argmax and nothing else (no logprobs, no penalties)."""
    return sequence.sampler.params.is_plain_greedy() and sequence.request.logprobs is None


def _step_shape(sequences: list[_Sequence]) -> tuple[int, int]:
    """(rows, longest attention span) of a graph decode step over `sequences`: rows start at slot 0."""
    return max(s.slot for s in sequences) + 1, max(s.cached + s.launched for s in sequences) + 1


class Engine:
    """Runs `load` and then every forward pass on its own thread.

    The engine owns the model that `load` returns and may change it in place (on a CPU its linear layers are
    swapped for oneDNN-packed ones), so `load` must not hand over a model that is used elsewhere.

    Loading happens on the engine thread too because the thread that first runs torch's CPU kernels keeps them
    fast: measured here, decoding on a thread other than the one that loaded the model ran at half the speed
    (20 vs 44 tok/s, demo model, fp16, 2 cores), while loading and decoding on one thread matched the main thread.
    """

    def __init__(
        self, load: Callable[[], LoadedModel], config: EngineConfig | None = None, observer: EngineObserver | None = None
    ) -> None:
        config = config or EngineConfig()
        self.config = config
        self.deterministic = config.deterministic
        self.max_batch, self.max_queue, self.prefill_chunk = config.max_batch, config.max_queue, config.prefill_chunk
        self._kv_cache_bytes = config.kv_cache_bytes  # None: sized from the memory left after the weights
        # Batched decode steps on a GPU as CUDA graphs (not in deterministic mode, which decodes row by row).
        self._use_cuda_graphs = config.cuda_graphs and not config.deterministic
        self._graphs: DecodeGraphs | None = None
        self._pending: _Launched | None = None  # a graph decode step whose tokens the host has not taken yet
        self._prefill_graphs: PrefillGraphs | None = None  # first prompt chunks, for the plain (uncompiled) forward
        self._compile = config.compile_model  # the forward through torch.compile (inside the CUDA graphs on a GPU)
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
        self._cache: SlotCache | None = None
        self._free_slots: list[int] = []
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

    @functools.cached_property
    def vocab_size(self) -> int:
        # Counted once: len() of a fast tokenizer asks the Rust tokenizer to count its vocabulary with the added
        # tokens, which took 4 ms a call on the GPU hosts' tokenizers build (profiled there: most of a request's
        # time before it reached the engine).
        return len(self.loaded.tokenizer)

    @property
    def context_length(self) -> int:
        """The most tokens (prompt + generated) one request may hold: the model's context, or less when the KV
        cache slots are shorter (see SlotCache sizing)."""
        self.loaded  # noqa: B018 -- waits for the load (and the cache) like every caller-side method
        assert self._cache is not None
        return self._cache.slot_len

    def validate(self, request: Request) -> None:
        """Raise RequestError for a request that cannot run on this model."""
        context = self.context_length
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
        """The share of the KV cache's token positions that running requests hold; 0 before the model is loaded."""
        cache = self._cache
        if cache is None:
            return 0.0
        used = sum(s.cached for s in list(self._active.values()))
        return used / (cache.slots * cache.slot_len)

    def memory_bytes(self) -> int:
        """Measured device memory in use: the weights plus the KV cache (on a CPU, the part of it touched so far)."""
        info = self.loaded.info
        if info.device.type == "cuda":
            return int(torch.cuda.memory_allocated(info.device))
        return info.weight_bytes + (self._cache.resident_bytes if self._cache else 0)

    # -- the engine thread ------------------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            loaded = self._load()
            merge_projections(loaded.model)
            if not self._compile:  # inductor packs the weights of what it compiles itself
                loaded = self._pack_for_cpu(loaded)
            use_engine_attention(loaded.model)
            self._model = loaded.model
            self._dtype = loaded.info.dtype
            self._cache_kwarg = cache_kwarg(loaded.model)
            self._cache = self._allocate_cache(loaded)
            self._prepare_forward(loaded)
            self._loaded = loaded
        except BaseException as exc:  # handed to the caller through `loaded`
            self._load_error = exc
            return
        finally:
            self._ready.set()
        self._eos = loaded.info.eos_token_ids
        self._free_slots = list(range(self.max_batch))
        with torch.inference_mode():
            while self._admit(block=not self._active):
                running = list(itertools.islice(self._active.values(), self.max_batch))
                for sequence in running:
                    if sequence.cancelled:
                        self._finish(sequence, StopReason.CANCELLED)
                    elif sequence.slot is None:
                        sequence.slot = self._free_slots.pop(self._free_slots.index(min(self._free_slots)))
                running = [s for s in running if not s.cancelled]
                decoding = [s for s in running if s.cached >= len(s.request.prompt_ids)]
                self._prefill([s for s in running if s.cached < len(s.request.prompt_ids)])
                self._decode(decoding)
                self._last_progress = time.monotonic()
            for sequence in list(self._active.values()):
                self._finish(sequence, StopReason.CANCELLED)

    def _allocate_cache(self, loaded: LoadedModel) -> SlotCache:
        """One KV slot of up to the model's context per running request, within the memory budget."""
        info, config = loaded.info, loaded.model.config
        per_token = kv_bytes_per_token(config, info.dtype)
        budget = self._kv_cache_bytes if self._kv_cache_bytes is not None else kv_budget(info.device)
        slot_len = min(info.context_length, budget // (self.max_batch * per_token))
        if slot_len < MIN_SLOT_TOKENS:
            raise ModelLoadError(
                f"the KV cache for --max-batch {self.max_batch} does not fit in {budget / 2**30:.1f} GiB "
                f"({per_token} bytes per token): lower --max-batch or give the cache more memory"
            )
        log.info(
            "KV cache: %d slots of %d tokens, %.2f GiB",
            self.max_batch,
            slot_len,
            self.max_batch * slot_len * per_token / 2**30,
            extra={"fields": {"slots": self.max_batch, "slot_tokens": slot_len}},
        )
        return SlotCache(config, self.max_batch, slot_len, info.dtype, info.device)

    @staticmethod
    def _pack_for_cpu(loaded: LoadedModel) -> LoadedModel:
        """On a CPU, the linear layers' weights reordered once for oneDNN (see cpu_linear.py); the weight bytes
        measured again, since the plain weights are gone (a tied LM head's packed copy comes on top)."""
        if not can_pack(loaded.model):
            return loaded
        pack_linears(loaded.model)
        weight_bytes = tensor_bytes(loaded.model) + packed_bytes(loaded.model)
        return dataclasses.replace(loaded, info=dataclasses.replace(loaded.info, weight_bytes=weight_bytes))

    def _prepare_forward(self, loaded: LoadedModel) -> None:
        """Before the worker reports ready: with --compile, the forward through torch.compile (see
        compiled.py), run once for each class of shapes so that no request waits for a compilation; on a GPU, the
        decode and first-chunk graphs captured for the common shapes (of the compiled or the plain layers)."""
        graphs = self._use_cuda_graphs and loaded.info.device.type == "cuda"
        if not (graphs or self._compile):
            return
        started = time.perf_counter()
        with torch.inference_mode():
            if self._compile:
                try:
                    compile_model(loaded.model, self._cache)
                    self._warm_up(graphs)
                except Exception as exc:  # e.g. no Triton for this GPU, no C++ compiler: slower, but it runs
                    log.warning("torch.compile failed, running the model uncompiled: %s", str(exc).splitlines()[0])
                    self._compile = False
                    uncompile_model(loaded.model, self._cache)
                    self._graphs = self._prefill_graphs = None
            if graphs and self._graphs is None:
                self._warm_up(graphs)
        log.info(
            "prepared the %s forward in %.1f s (%d CUDA graphs)",
            "compiled" if self._compile else "plain",
            time.perf_counter() - started,
            len(self._graphs.graphs if self._graphs else ())
            + len(self._prefill_graphs.graphs if self._prefill_graphs else ()),
        )

    def _warm_up(self, graphs: bool) -> None:
        """With `graphs`, capture the decode graphs up to GRAPH_WARM_SPAN and the first-chunk prefill graphs. Compiled
        layers also run the forwards that stay eager once (on a GPU prompt chunks of one and two rows, of different
        lengths; without graphs decode steps of one and two rows), so that they are compiled for any shape before the
        first request (tests/test_compile.py fails any compilation after ready)."""
        if graphs:
            self._graphs = DecodeGraphs(self._model, self._cache, self._cache_kwarg, self._dtype)
            self._graphs.warm_up(max_span=GRAPH_WARM_SPAN)
            self._prefill_graphs = PrefillGraphs(
                self._model, self._cache, self._cache_kwarg, self._dtype, self.prefill_chunk, self._graphs.pool
            )
            self._prefill_graphs.warm_up()
        if self._compile and not self._eager_prompts:
            # Slots 0 and 1, which no request holds yet. First chunks of one token (dynamo specializes sizes of 1) and
            # of two lengths (it took the first length it met for a constant); on a GPU, where first chunks run as
            # graphs, eager chunks attending to a multiple of 8 positions and to others (inductor's kernels guard on
            # that alignment: 17-token prompts batched together recompiled for seconds after ready).
            for count in (1, 16, 24):
                self._prompt_forward([0], [([0] * count, 0)])
            for count in (48, 17):
                self._prompt_forward([0], [([0] * count, 16)])
            if self._cache.slots > 1:
                for long, short in ((16, 8), (17, 9)):
                    self._prompt_forward([0, 1], [([0] * long, 0), ([0] * short, 0)])
        if self._compile and not graphs:
            for rows in range(1, min(self._cache.slots, 2) + 1):
                self._decode_step([0] * rows, [32] * rows, [33] * rows, first=0)
        if self._model.device.type == "cuda":
            torch.cuda.synchronize(self._model.device)

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
                # Ended here rather than at its next step: its KV slot is freed and its id can be reused at once.
                if sequence := self._active.get(item):
                    self._finish(sequence, StopReason.CANCELLED)
            else:
                self._active[item.request.request_id] = item
                item.send(Started(item.request.request_id, len(item.request.prompt_ids), item.seed))

    def _prefill(self, sequences: list[_Sequence]) -> None:
        """Up to `prefill_chunk` prompt tokens, oldest request first; a sequence whose prompt is complete samples its
        first token. Chunks of several requests share a forward while their rows, padded to the longest chunk, hold
        at most prefill_chunk tokens (many short prompts: one forward instead of one each); in deterministic mode
        each chunk has a forward of its own."""
        budget = self.prefill_chunk
        chunks: list[tuple[_Sequence, int, int]] = []  # (sequence, start, count)
        for sequence in sequences:
            prompt = sequence.request.prompt_ids
            # In deterministic mode chunks end at multiples of prefill_chunk whatever else ran in this round: a chunk
            # that does not fit in what is left of the round's budget waits for the next round.
            room = self.prefill_chunk - sequence.cached % self.prefill_chunk if self.deterministic else budget
            count = min(room, len(prompt) - sequence.cached)
            if count > budget or budget <= 0:
                break
            budget -= count
            chunks.append((sequence, sequence.cached, count))
        group: list[tuple[_Sequence, int, int]] = []
        for chunk in chunks:
            width = max(count for _, _, count in (*group, chunk))
            if group and (self.deterministic or (len(group) + 1) * width > self.prefill_chunk):
                self._prefill_forward(group)
                group = []
            group.append(chunk)
        if group:
            self._prefill_forward(group)

    def _prefill_forward(self, chunks: list[tuple[_Sequence, int, int]]) -> None:
        """One forward over prompt chunks (sequence, start, count), a batch row each."""
        sequences = [sequence for sequence, _, _ in chunks]
        with self._failing(sequences):
            pieces = [(s.request.prompt_ids[start : start + count], start) for s, start, count in chunks]
            logits = self._prompt_forward([s.slot for s in sequences], pieces)
            for row, (sequence, _, count) in enumerate(chunks):
                sequence.cached += count
                if sequence.cached == len(sequence.request.prompt_ids):
                    self._sample(sequence, logits[row])

    def _prompt_forward(self, slots: list[int], pieces: list[tuple[Sequence[int], int]]) -> torch.Tensor:
        """Row b feeds the token ids pieces[b][0] at positions pieces[b][1].. of slot slots[b]; rows are left-padded
        to the longest (padding writes the scratch position), so the logits returned, one row each, follow each
        row's last token."""
        width = max(len(ids) for ids, _ in pieces)
        if self._prefill_graphs and len(pieces) == 1 and pieces[0][1] == 0 and self._prefill_graphs.fits(width):
            return self._prefill_graphs.run(slots[0], list(pieces[0][0]))
        tokens, positions = [], []
        for ids, start in pieces:
            pad = width - len(ids)
            tokens.append([0] * pad + list(ids))
            positions.append([self._cache.slot_len] * pad + list(range(start, start + len(ids))))
        kv_len = max(start + len(ids) for ids, start in pieces)
        device = self._model.device
        position_ids = torch.tensor(positions, device=device)
        self._cache.prepare_slots(slots, position_ids, kv_len)
        starts, counts = [start for _, start in pieces], [len(ids) for ids, _ in pieces]
        mask = prefill_mask(starts, counts, kv_len, self._dtype, device)
        with torch.compiler.set_stance("force_eager") if self._eager_prompts else contextlib.nullcontext():
            return self._forward(torch.tensor(tokens, device=device), position_ids, mask)

    @property
    def _eager_prompts(self) -> bool:
        """Whether prompt forwards skip the compiled forward: on a CPU. There only decode steps are compiled. A prompt
        forward holds enough tokens that the Python around its kernels costs little; a long one runs faster eagerly,
        where its int4 / int8 products dequantize their matrices for oneDNN (dequant.cpu_product_dequantizes), which
        compiled they cannot; and every class of prompt shapes would take another whole-model compilation at start-up
        (12 to 63 s each on 2 cores, for 4 of the 6 classes)."""
        return self._compile and self._model.device.type == "cpu"

    def _decode(self, sequences: list[_Sequence]) -> None:
        """One token for each sequence: one batched forward (a forward each in deterministic mode)."""
        if self._graphs:
            self._decode_graphs(sequences)
        elif self.deterministic:
            for sequence in sequences:
                self._decode_rows([sequence])
        elif sequences:
            self._decode_rows(sequences)

    def _decode_rows(self, sequences: list[_Sequence]) -> None:
        """An eager forward over the cache rows from the lowest to the highest slot of `sequences`; rows in between
        that are not theirs (free slots, sequences still in prefill) compute a throwaway token into the scratch
        position."""
        first = min(s.slot for s in sequences)
        rows = max(s.slot for s in sequences) + 1 - first
        tokens, positions, lengths = [0] * rows, [self._cache.slot_len] * rows, [0] * rows
        for s in sequences:
            tokens[s.slot - first] = s.output_ids[-1]
            positions[s.slot - first] = s.cached
            lengths[s.slot - first] = s.cached + 1
        with self._failing(sequences):
            logits = self._decode_step(tokens, positions, lengths, first)
            best = greedy_rows(logits).tolist() if any(_plain(s) for s in sequences) else []
            for s in sequences:
                s.cached += 1
            self._choose(sequences, logits, first, best)

    def _decode_step(self, tokens: list[int], positions: list[int], lengths: list[int], first: int) -> torch.Tensor:
        """The eager forward of one decode step over cache rows first.. first + len(tokens) - 1."""
        device = self._model.device
        position_ids = torch.tensor(positions, device=device)[:, None]
        kv_len = max(lengths)
        self._cache.prepare(first, position_ids, kv_len)
        mask = decode_mask(torch.tensor(lengths, device=device), kv_len, self._dtype)
        return self._forward(torch.tensor(tokens, device=device)[:, None], position_ids, mask)

    def _decode_graphs(self, sequences: list[_Sequence]) -> None:
        """One decode step as a CUDA graph over cache rows 0.. (the highest slot of `sequences`), rows that are not
        theirs computing a throwaway token into the scratch position.

        When every sequence decodes greedily with nothing but the token (the common case), the host does not wait for
        the step: it launches it, then reads the previous step's tokens while this one runs, and the graph takes each
        continuing row's token from the previous step's result on the GPU. The host's work per token (reading the
        result, detokenizing, handing out events, filling the next step's inputs) then overlaps the GPU's instead of
        adding to it. A sequence that the previous step ends (EOS, a stop string) has its row of this step computed
        and thrown away; its KV write lands in its freed slot beyond what the next holder has written, and every
        position is written before it is read."""
        graphs, pending, self._pending = self._graphs, self._pending, None
        overlap = all(_plain(s) for s in sequences)
        launch = self._launchable(sequences)
        if pending and not (overlap and launch and graphs.captured(*_step_shape(launch))):
            self._collect(pending)
            pending = None
            launch = self._launchable(sequences)
        step = None
        if launch:
            with self._failing(launch):
                step = self._launch(launch)
        if pending:
            self._collect(pending)
        if step:
            if overlap:
                self._pending = step
            else:
                self._collect(step)

    def _launchable(self, sequences: list[_Sequence]) -> list[_Sequence]:
        """The sequences that are still running and have a token to generate after those already launched."""
        return [
            s
            for s in sequences
            if self._active.get(s.request.request_id) is s and len(s.output_ids) + s.launched < s.request.max_tokens
        ]

    def _launch(self, sequences: list[_Sequence]) -> _Launched:
        rows, _ = _step_shape(sequences)
        tokens, positions, lengths, chained = [0] * rows, [self._cache.slot_len] * rows, [0] * rows, [False] * rows
        for s in sequences:
            position = s.cached + s.launched
            tokens[s.slot] = s.output_ids[-1]
            positions[s.slot], lengths[s.slot], chained[s.slot] = position, position + 1, s.launched > 0
            s.launched += 1
        return _Launched(sequences, self._graphs.launch(tokens, positions, lengths, chained))

    def _collect(self, launched: _Launched) -> None:
        """Wait for a launched step and take its tokens, for the sequences that still run."""
        sequences = launched.sequences
        for s in sequences:
            s.launched -= 1
        sequences = [s for s in sequences if self._active.get(s.request.request_id) is s]
        with self._failing(sequences):
            best = launched.step.result()
            for s in sequences:
                s.cached += 1
            self._choose(sequences, launched.step.logits, 0, best)

    def _choose(self, sequences: list[_Sequence], logits: torch.Tensor, first: int, best: list[list[float]]) -> None:
        """Each sequence's next token from its row (slot - first) of `logits`: plain greedy rows take it from `best`,
        the rows' (largest logit, its id) computed where the logits are, so only those cross to the host; the others
        are sampled on the host from one copy of their rows."""
        others: list[_Sequence] = []
        for s in sequences:
            if not _plain(s):
                others.append(s)
                continue
            value, token = best[s.slot - first]
            if math.isfinite(value):  # a NaN anywhere comes out as the maximum
                self._accept(s, int(token), None)
            else:
                self._fail(s, ErrorCode.INFERENCE_FAILED, "inference failed: the model's logits are not finite")
        if others:
            host = logits[[s.slot - first for s in others]].float().cpu()
            for row, s in enumerate(others):
                self._sample(s, host[row])

    def _forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The model's next-token logits for each batch row: (rows, vocab)."""
        output = self._model(
            input_ids=input_ids,
            position_ids=position_ids,
            attention_mask=mask,
            use_cache=True,
            logits_to_keep=1,
            **{self._cache_kwarg: self._cache},
        )
        return output.logits[:, -1]

    def _sample(self, sequence: _Sequence, logits: torch.Tensor) -> None:
        with self._failing([sequence]):
            token = sequence.sampler(logits, sequence.output_ids)
            top = sequence.request.logprobs
            logprob = None if top is None else _logprob(logits, token, top)
        if sequence.request.request_id in self._active:  # not failed just now
            self._accept(sequence, token, logprob)

    @contextlib.contextmanager
    def _failing(self, sequences: list[_Sequence]) -> Iterator[None]:
        """A failure inside ends these requests with an error event, never the engine thread."""
        try:
            yield
        except torch.OutOfMemoryError:
            for sequence in sequences:
                self._fail(sequence, ErrorCode.VRAM_OOM, "out of device memory during generation; retry shorter")
        except Exception as exc:
            log.exception("inference failed for request(s) %s", ", ".join(s.request.request_id for s in sequences))
            for sequence in sequences:
                self._fail(sequence, ErrorCode.INFERENCE_FAILED, f"inference failed: {exc}")

    def _accept(self, sequence: _Sequence, token: int, logprob: TokenLogprob | None) -> None:
        now = time.perf_counter()
        if sequence.last_token_at is None:
            sequence.first_token_at = now
            self._observer.first_token(now - sequence.submitted_at)
        else:
            self._observer.next_token(now - sequence.last_token_at)
        sequence.last_token_at = now
        if token in self._eos and not sequence.request.ignore_eos:
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
                kv_cache_bytes=sequence.cached * self._cache.bytes_per_token,
            ),
        )

    def _fail(self, sequence: _Sequence, code: ErrorCode, message: str) -> None:
        self._retire(sequence, Error(sequence.request.request_id, code, message))

    def _retire(self, sequence: _Sequence, terminal: End | Error) -> None:
        """Free the request's slot and KV cache, then send its one terminal event."""
        if self._active.get(sequence.request.request_id) is sequence:
            del self._active[sequence.request.request_id]
        if sequence.slot is not None:
            self._free_slots.append(sequence.slot)
            sequence.slot = None
            sequence.cached = 0
        with self._in_flight_lock:
            self._in_flight.discard(sequence.request.request_id)
        # Counted and logged before the caller hears of it: a client that reads /metrics right after its response
        # sees its request there (the other order lost that race once responses stopped waiting on Nagle).
        self._observer.finished(sequence.request, terminal, time.perf_counter() - sequence.submitted_at)
        _log_finished(sequence.request, terminal)
        sequence.send(terminal)


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


def cache_kwarg(model: torch.nn.Module) -> str:
    """The name of forward's cache argument: transformers renamed `past_key_values` to `cache` in 5.2x, and the GPU
    machines still run 5.17."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def kv_budget(device: torch.device) -> int:
    """Bytes the KV cache may take by default: on a GPU, what is free once the weights are in, less room for
    activations; elsewhere half the memory available, touched only as contexts grow (see SlotCache)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * GPU_KV_SHARE) - ACTIVATION_RESERVE_BYTES
    return int(psutil.virtual_memory().available * CPU_KV_SHARE)


def _logprob(logits: torch.Tensor, token: int, top: int) -> TokenLogprob:
    """The chosen token's log-probability and the `top` most likely, from the raw logits (as vLLM's default)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    values, ids = torch.topk(logprobs, top) if top else (logprobs[:0], logprobs[:0].long())
    pairs = tuple(zip(ids.tolist(), values.tolist(), strict=True))
    return TokenLogprob(token, float(logprobs[token]), pairs)
