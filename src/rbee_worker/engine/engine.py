"""The engine: one thread owns the model runner and the scheduler; callers submit requests and receive events.

Each round of the loop: take new requests and cancellations from the inbox, then one step of engine/core.py's loop
(schedule -> execute -> update -> output), and deliver the terminal events of the requests it ended. At most
`max_batch` requests run at once, at most `max_queue` wait: a request beyond both is refused at once (EngineBusy)
rather than queued without end.

A failure that leaves the device unusable (`DeviceFault`) fails every request in flight, sets `fault`, and ends the
thread: the worker reports itself unhealthy and stops, so that the pool manager restarts it.
"""

import asyncio
import gc
import logging
import queue
import threading
import time
import weakref
from collections.abc import Callable, Iterator

import torch

from rbee_worker.engine.core import EngineCore, make_runner
from rbee_worker.engine.detokenizer import Detokenizer
from rbee_worker.engine.engine_config import EngineConfig
from rbee_worker.engine.mailbox import EventStream, LoopMailbox
from rbee_worker.engine.output_processor import Ended, EngineObserver, log_finished, send
from rbee_worker.engine.plan import Output, Sequence, Sink
from rbee_worker.engine.request_checks import RequestError
from rbee_worker.engine.request_types import End, Error, ErrorCode, Event, Request
from rbee_worker.engine.runners.protocol import DeviceFault, Runner
from rbee_worker.engine.sampling.sampling_params import random_seed
from rbee_worker.engine.sampling.seeded_draws import check_seed
from rbee_worker.engine.scheduling.scheduler import Proposer
from rbee_worker.engine.served_model import ServedModel
from rbee_worker.loading.loaded import LoadedModel

log = logging.getLogger(__name__)


class DuplicateRequest(RuntimeError):
    """A request with this id is already in flight."""


class EngineBusy(RuntimeError):
    """Every running slot and every queue place is taken; the caller should retry later."""

    def __init__(self, max_batch: int, max_queue: int, in_flight: int) -> None:
        super().__init__(f"all {max_batch} slots and {max_queue} queue places are taken; retry shortly")
        self.max_batch, self.max_queue, self.in_flight = max_batch, max_queue, in_flight


class Engine:
    """Runs `load`, makes the model's runner (`runner`: make_runner, or another Runner), and then
    every step on its own thread; `proposer`: tokens proposed for decode rows to verify, where the runner's rows carry
    several (Capabilities.row_tokens).

    The engine owns the model that `load` returns and may change it in place (on a CPU its linear layers are
    swapped for oneDNN-packed ones), so `load` must not hand over a model that is used elsewhere.

    Loading happens on the engine thread too because the thread that first runs torch's CPU kernels keeps them
    fast: decoding on another thread than the one that loaded the model runs markedly slower on a CPU
    (bench/results/README.md).
    """

    def __init__(
        self,
        load: Callable[[], LoadedModel],
        config: EngineConfig | None = None,
        observer: EngineObserver | None = None,
        runner: Callable[[LoadedModel, EngineConfig], Runner] = make_runner,
        proposer: Proposer | None = None,
    ) -> None:
        config = config or EngineConfig()
        self.config = config
        self.max_batch, self.max_queue = config.max_batch, config.max_queue
        self._observer = observer
        self._load, self._make_runner, self._proposer = load, runner, proposer
        self._loaded: LoadedModel | None = None
        self._mailboxes: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, LoopMailbox] = weakref.WeakKeyDictionary()
        self._load_error: BaseException | None = None
        self._ready = threading.Event()
        self._inbox: queue.SimpleQueue[Sequence | str | DeviceFault | None] = queue.SimpleQueue()
        self._in_flight: set[str] = set()  # ids submitted and not yet ended: inbox, running and waiting requests
        self._in_flight_lock = threading.Lock()
        self._last_progress = time.monotonic()  # the end of the latest step (or of the latest idle wait)
        self._runner: Runner | None = None
        self._core: EngineCore | None = None
        self._model: ServedModel | None = None  # made at load (`model`)
        self._fault: str | None = None
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
    def fault(self) -> str | None:
        """Why the device is unusable, once a step found it so (the engine has stopped); None before."""
        return self._fault

    def fault_message(self) -> str:
        """What the callers of a failed device are told (every error event, /health, refused jobs)."""
        return f"the worker's device failed and the worker stops: {self._fault}"

    @property
    def loaded(self) -> LoadedModel:
        """The model, once loaded (blocks until then); raises what loading raised."""
        self._ready.wait()
        if self._loaded is None:
            raise self._load_error or RuntimeError("the engine was closed before the model loaded")
        return self._loaded

    # -- the caller's side (any thread) ------------------------------------------------------------------------

    @property
    def model(self) -> ServedModel:
        """What callers ask of the loaded model (tokenizer, chat template, limits, grammars), once it is loaded
        (blocks until then); raises what loading raised."""
        self.loaded  # noqa: B018 -- waits for the load
        assert self._model is not None
        return self._model

    def submit(self, request: Request, sink: Sink) -> None:
        """Queue a request; `sink` gets Started, Token*, then exactly one End or Error, from the engine thread.

        Raises DuplicateRequest when a request with the same id is in flight and EngineBusy when the running slots
        and the queue are full, both before anything is sent.
        """
        try:
            if self._closed.is_set():
                raise RequestError("the engine is shut down")
            self.model.validate(request)
            seed = random_seed() if request.seed is None else check_seed(request.seed)
        except (RequestError, ValueError) as exc:
            sink(Error(request.request_id, ErrorCode.INVALID_REQUEST, str(exc)))
            return
        output = Output(sink, Detokenizer(self.loaded.tokenizer.backend_tokenizer, request.stop))
        if request.grammar is not None:
            output.grammar = self.model.grammars.matcher(request.grammar, request.reasoning, request.prompt_ids)
        sequence = Sequence(request, seed, output)
        with self._in_flight_lock:
            if self._fault is not None:
                sink(Error(request.request_id, ErrorCode.INFERENCE_FAILED, self.fault_message()))
                return
            if request.request_id in self._in_flight:
                raise DuplicateRequest(f"request {request.request_id} is already running")
            if len(self._in_flight) >= self.max_batch + self.max_queue:
                raise EngineBusy(self.max_batch, self.max_queue, len(self._in_flight))
            self._in_flight.add(request.request_id)
            self._inbox.put(sequence)  # under the lock: a fault that drains the inbox sees it there

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

    def astream(self, request: Request) -> EventStream:
        """Submit now (raising EngineBusy at once) and return the request's events on the running event loop;
        closing the stream before its end, a cancelled read or dropping it cancels the request.

        Only queues cross threads here: the event loop never runs model code (see the class docstring).
        """
        loop = asyncio.get_running_loop()
        mailbox = self._mailboxes.get(loop)
        if mailbox is None:
            mailbox = self._mailboxes[loop] = LoopMailbox(loop)
        events: asyncio.Queue[Event] = asyncio.Queue()
        self.submit(request, lambda event: mailbox.post(events.put_nowait, event))
        return EventStream(events, lambda: self.cancel(request.request_id))

    def cancel(self, request_id: str) -> None:
        """Stop a request between two steps; it ends with stop reason CANCELLED. Unknown ids are ignored."""
        self._inbox.put(request_id)

    def fail(self, reason: str) -> None:
        """From any thread: the device is unusable for a reason found outside the engine's steps (a rank of a
        tensor-parallel worker has died); the engine thread stops at its next round as after a DeviceFault in a step,
        even while idle."""
        self._inbox.put(DeviceFault(reason))

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
        self._end_inbox(ErrorCode.CANCELLED, "the engine shut down")
        if self._model is not None:
            self._model.close()
        # What freeze_heap froze goes back to the collector, so that the interpreter's finalization frees it: frozen
        # objects outlive it, and extensions that check for leaks at exit (Triton's nanobind) report them on stderr.
        gc.unfreeze()

    @property
    def running_requests(self) -> int:
        """Requests holding one of the max_batch batch rows (the others in flight wait for one)."""
        return len(self._core.scheduler.running) if self._core else 0

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
        """The share of the KV block pool that running requests hold; 0 before the model is loaded."""
        if self._core is None:
            return 0.0
        blocks = self._core.scheduler.kv.blocks
        return blocks.used_blocks / blocks.capacity

    def prefix_cache_tokens(self) -> tuple[int, int]:
        """Prompt tokens looked up in the prefix cache since start, and of them found there."""
        if self._core is None:
            return 0, 0
        return self._core.scheduler.kv.blocks.queried_tokens, self._core.scheduler.kv.blocks.hit_tokens

    @property
    def preemptions(self) -> int:
        """Running requests preempted since start (their KV blocks freed for older requests, recomputed later)."""
        return self._core.scheduler.preemptions if self._core is not None else 0

    def memory_bytes(self) -> int:
        """Measured device memory in use: the weights plus the KV cache (the runner says how it measures them)."""
        self.loaded  # noqa: B018 -- waits for the load
        assert self._runner is not None
        return self._runner.memory_bytes()

    def kv_cache_bytes(self) -> int:
        """Bytes of KV cache in memory; 0 before the model is loaded."""
        return self._runner.kv_bytes() if self._runner is not None else 0

    def prompt_cache_bytes(self) -> int:
        """Host memory the runtime's own prompt cache holds (llama.cpp's saved sequence states); 0 before the model
        is loaded."""
        return self._runner.prompt_cache_bytes() if self._runner is not None else 0

    # -- the engine thread ------------------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._runner = self._make_runner(self._load(), self.config)
            self._core = EngineCore(self._runner, self.config, self._observer, self._proposer)
            runner = self._runner
            self._model = ServedModel(runner.loaded, runner.kv.context, runner.vocab_size, self.config)
            self._loaded = runner.loaded
            freeze_heap()
        except BaseException as exc:  # handed to the caller through `loaded`
            self._load_error = exc
            return
        finally:
            self._ready.set()
        core = self._core
        try:
            with torch.inference_mode():
                while self._admit(block=len(core.scheduler) == 0):
                    self._deliver(core.step())
                    self._last_progress = time.monotonic()
                self._deliver(core.stop())
        except DeviceFault as fault:
            self._stop(str(fault))
            return
        except Exception as exc:  # a bug in the loop's own bookkeeping: its state is unknown, so it stops as on a fault
            log.exception("internal error in the engine's step loop")
            self._stop(f"internal error in the engine's step loop: {exc}")
            return
        self._runner.close()

    def _stop(self, reason: str) -> None:
        """The device is unusable: every request in flight (running, waiting, in the inbox) ends with an error, and
        no new one is taken."""
        log.error("the device is unusable; failing every request and stopping: %s", reason)
        with self._in_flight_lock:
            self._fault = reason
        error = self.fault_message()
        assert self._core is not None
        self._deliver(self._core.fail_all(ErrorCode.INFERENCE_FAILED, error))
        self._end_inbox(ErrorCode.INFERENCE_FAILED, error)

    def _end_inbox(self, code: ErrorCode, message: str) -> None:
        """End every request still in the inbox with this error (cancellations there are moot)."""
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(item, Sequence):  # never admitted: no row or blocks to free
                self._end(item, Error(item.request_id, code, message))

    def _admit(self, block: bool) -> bool:
        """Take new requests and cancellations from the inbox; False once the engine is closing."""
        assert self._core is not None
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
            if isinstance(item, DeviceFault):
                raise item
            if isinstance(item, str):
                # Ended here rather than at its next step: its KV blocks are freed and its id can be reused at once.
                self._deliver(self._core.cancel(item))
            else:
                self._core.add(item)

    def _deliver(self, ended: list[Ended]) -> None:
        for sequence, terminal in ended:
            self._end(sequence, terminal)

    def _end(self, sequence: Sequence, terminal: End | Error) -> None:
        """Its id may come again, and its caller hears of the request's end."""
        with self._in_flight_lock:
            self._in_flight.discard(sequence.request_id)
        log_finished(sequence.request, terminal)
        send(sequence, terminal)


def freeze_heap() -> None:
    """Move every object alive now (the model, its tokenizer, torch.compile's and transformers' structures) into the
    collector's permanent generation, as vLLM does after its warm-up. A full collection walks every tracked object:
    with that heap it stalls the step loop and the HTTP thread, for a time that grows with the heap, at whichever
    request happens to trigger it. Frozen objects are never walked again; what requests create is collected as
    before."""
    started = time.perf_counter()
    gc.collect()
    gc.freeze()
    took = time.perf_counter() - started
    log.debug("froze %d objects out of the garbage collector's reach in %.2f s", gc.get_freeze_count(), took)
