"""Tensor parallelism's processes and rank 0's runner: one `serve` runs a model split over N ranks
(models/tensor_parallel.py), rank 0 in its own process (HTTP, the scheduler, the sampler) and ranks 1..N-1 in
processes that it starts itself (engine/tp_rank.py, each with a FollowerRunner), joined by torch.distributed: gloo on
CPUs, NCCL on CUDA GPUs.

Every rank runs the same forwards over its shard in the same order, so that their all-reduces pair up: rank 0's
runner (TensorParallelRunner: the Runner protocol of engine/runner.py around rank 0's own TorchRunner) sends each
forward's rows (the plain PromptRow / DecodeRow dataclasses, pickled) to the other ranks before it computes the
forward itself. They go down each rank's stdin pipe: a pipe needs no timeout while the worker idles, and a rank whose
rank 0 has died reads the end of it. What only rank 0 needs stays there: the sampling state (`assign`, `mask`: the
logits are sampled on rank 0 alone) and the block accounting (`evict`, `release`, `reuse`: the torch runner keeps
nothing beyond the KV blocks, whose tables every forward's rows carry).

Off under tensor parallelism for now, rather than half supported: CUDA graphs and torch.compile (no all-reduce is
captured in a graph yet), and decode steps launched ahead or chained (each step is finished when `launch` returns).

Faults: a rank that exits is seen within a fraction of a second (Ranks' watcher), and the worker stops; a forward
that fails on rank 0 leaves the ranks' collectives out of step, so it stops the worker too (DeviceFault). The other
ranks end with rank 0: its pipe closes, and each also watches its parent process.
"""

import contextlib
import dataclasses
import logging
import pickle
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import TypeVar

import torch
import torch.distributed as dist

from rbee_worker.devices import Placement
from rbee_worker.engine.config import EngineConfig
from rbee_worker.engine.grammar import Matcher
from rbee_worker.engine.runner import (
    Capabilities,
    DecodeRow,
    DeviceFault,
    KvGeometry,
    Launched,
    PromptRow,
    Sampled,
)
from rbee_worker.engine.sampling import SamplingParams
from rbee_worker.engine.torch_runner import TorchRunner, size_pool
from rbee_worker.errors import ModelLoadError
from rbee_worker.models.loaded import LoadedModel
from rbee_worker.models.tensor_parallel import shard_loaded

log = logging.getLogger(__name__)
_T = TypeVar("_T")

POLL_S = 0.1  # how often rank 0 looks at its ranks' processes
LOST_WAIT_S = 1.0  # after a failed collective, how long to look for the rank whose exit failed it
CLOSE_S = 5.0  # how long ranks get to exit once their pipe is closed, before they are killed
# Collectives wait this long for a peer (the one wait that can be long: every rank's load, before the first gather).
GROUP_TIMEOUT = timedelta(minutes=30)


@dataclass(frozen=True)
class RankSetup:
    """What a rank beyond 0 needs to load its shard: the first message down its pipe."""

    rank: int
    world: int
    init_method: str  # torch.distributed's rendezvous: tcp://host:port of rank 0
    model: str
    placement: Placement  # this rank's device
    quantize: str
    max_context: int | None
    threads: int | None  # torch's CPU threads
    log_level: str
    log_format: str | None


@dataclass(frozen=True)
class RunnerSetup:
    """The engine's settings and the KV pool's geometry, as rank 0 decided them: the second message."""

    config: EngineConfig
    kv: KvGeometry


@dataclass(frozen=True)
class Forward:
    """One forward's rows, as rank 0 runs it: prompt chunks, or decode rows."""

    prompts: list[PromptRow]
    decodes: list[DecodeRow]


def rank_placement(placement: Placement, rank: int) -> Placement:
    """Rank `rank`'s device: on CUDA the rank-th GPU from rank 0's, elsewhere the same device."""
    if placement.device.type != "cuda":
        return placement
    return Placement(torch.device("cuda", (placement.device.index or 0) + rank), placement.dtype)


def join(rank: int, world: int, init_method: str, placement: Placement) -> None:
    """Join the ranks' process group: gloo on a CPU, NCCL on CUDA (this rank's GPU made the current one)."""
    device = placement.device
    if device.type == "cuda":  # untested: no GPU on the machine this slice was written on
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world, timeout=GROUP_TIMEOUT)


def load_shard(rank: int, world: int, load: Callable[[], LoadedModel]) -> LoadedModel:
    """Load the model and cut this rank's shard (after `join`). Every rank then learns whether every other one loaded
    (one gather), so that a model that fails anywhere ends every rank with an error, never a hang in a later
    collective: this rank's own error is raised as it is, another rank's as a ModelLoadError."""
    loaded, error = None, None
    try:
        loaded = shard_loaded(load(), rank, world)
    except Exception as exc:  # reported to every rank below
        error = exc
    reports: list[str | None] = [None] * world
    dist.all_gather_object(reports, None if error is None else f"rank {rank} could not load the model: {error}")
    if error is not None:
        raise error
    if failed := next((report for report in reports if report), None):
        raise ModelLoadError(failed)
    assert loaded is not None
    return loaded


def serving_config(config: EngineConfig) -> EngineConfig:
    """The engine's settings as tensor parallelism runs them: no CUDA graphs, no torch.compile (see the module)."""
    return dataclasses.replace(config, cuda_graphs=False, compile_model=False)


class Ranks:
    """Ranks 1..world-1 as child processes of this one (rank 0), each fed through its stdin pipe; started at once, so
    that they load while rank 0 loads."""

    def __init__(
        self,
        world: int,
        placement: Placement,
        model: str,
        quantize: str,
        max_context: int | None,
        threads: int | None,
        log_level: str,
        log_format: str | None,
    ) -> None:
        self.world, self.placement, self.threads = world, placement, threads
        self.init_method = f"tcp://127.0.0.1:{_free_port()}"
        self.failure: str | None = None  # why a rank stopped, once one has
        self._closing = threading.Event()
        self.processes: list[subprocess.Popen[bytes]] = []
        for rank in range(1, world):
            setup = RankSetup(
                rank,
                world,
                self.init_method,
                model,
                rank_placement(placement, rank),
                quantize,
                max_context,
                threads,
                log_level,
                log_format,
            )
            command = [sys.executable, "-m", "rbee_worker.engine.tp_rank", f"--rank={rank}", f"--world={world}"]
            process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL)
            self.processes.append(process)
            self._write(process, pickle.dumps(setup))
        log.info(
            "tensor parallel: %d ranks, ranks 1..%d in processes %s",
            world,
            world - 1,
            ", ".join(str(p.pid) for p in self.processes),
            extra={"fields": {"tensor_parallel": world, "rank_pids": [p.pid for p in self.processes]}},
        )

    def load(self, load: Callable[[], LoadedModel]) -> LoadedModel:
        """Rank 0's load (on the engine thread): join the other ranks, load and cut rank 0's shard."""
        if self.threads is not None:
            torch.set_num_threads(self.threads)
        join(0, self.world, self.init_method, self.placement)
        return load_shard(0, self.world, load)

    def runner(self, loaded: LoadedModel, config: EngineConfig) -> "TensorParallelRunner":
        """Rank 0's runner (Engine's `runner` factory)."""
        return TensorParallelRunner(loaded, config, self)

    def send(self, message: object) -> None:
        """One message to every other rank; raises DeviceFault when a rank cannot take it (it has exited)."""
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        for process in self.processes:
            try:
                self._write(process, data)
            except (BrokenPipeError, ValueError, OSError) as exc:
                reason = self.lost(LOST_WAIT_S) or f"a tensor-parallel rank (pid {process.pid}) has exited"
                raise DeviceFault(reason) from exc

    def watch(self, on_failure: Callable[[str], None]) -> None:
        """Call `on_failure(reason)` once, from a thread of its own, when a rank exits before `close`."""

        def poll() -> None:
            while not self._closing.is_set():
                if (reason := self.lost()) is not None and not self._closing.is_set():
                    on_failure(reason)
                    return
                time.sleep(POLL_S)

        threading.Thread(target=poll, name="rbee-ranks", daemon=True).start()

    def lost(self, wait_s: float = 0.0) -> str | None:
        """Which rank has exited and how (kept in `failure`), looking for up to `wait_s` seconds; None: none has."""
        deadline = time.monotonic() + wait_s
        while self.failure is None:
            for rank, process in enumerate(self.processes, start=1):
                if (code := process.poll()) is not None:
                    how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
                    self.failure = f"tensor-parallel rank {rank} (pid {process.pid}) {how}"
                    break
            else:
                if time.monotonic() >= deadline:
                    return None
                time.sleep(POLL_S / 2)
        return self.failure

    def close(self, timeout_s: float = CLOSE_S) -> None:
        """End every other rank: their pipes close (each then exits), and the ones still there after `timeout_s` are
        killed. Safe to call more than once, from any thread."""
        self._closing.set()
        for process in self.processes:
            if process.stdin is not None:
                with contextlib.suppress(OSError):  # a rank that is gone
                    process.stdin.close()
        deadline = time.monotonic() + timeout_s
        for process in self.processes:
            try:
                process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()

    @staticmethod
    def _write(process: subprocess.Popen[bytes], data: bytes) -> None:
        assert process.stdin is not None
        process.stdin.write(data)
        process.stdin.flush()


class TensorParallelRunner:
    """Rank 0's runner: rank 0's TorchRunner over its shard, each forward's rows sent to the other ranks first."""

    # One forward at a time, each of one kind, finished when it returns (see the module docstring).
    capabilities = Capabilities(mixed_batches=False)

    def __init__(self, loaded: LoadedModel, config: EngineConfig, ranks: Ranks) -> None:
        config = serving_config(config)
        kv = size_pool(loaded, config)  # rank 0's pool, for every rank: the scheduler hands out its blocks
        ranks.send(RunnerSetup(config, kv))
        self.ranks = ranks
        self.local = TorchRunner(loaded, config, kv)
        self.loaded, self.kv, self.vocab_size = self.local.loaded, kv, self.local.vocab_size

    # -- rank 0's alone --------------------------------------------------------------------------------------------

    def assign(
        self, row: int, params: SamplingParams, seed: int, prompt_ids: Sequence[int], logprobs: int | None
    ) -> None:
        self.local.assign(row, params, seed, prompt_ids, logprobs)

    def masks(self, rows: Sequence[tuple[int, Matcher]]) -> None:
        self.local.masks(rows)

    def reuse(self, row: int, token_ids: Sequence[int], limit: int) -> int:
        return self.local.reuse(row, token_ids, limit)

    def evict(self, row: int) -> None:
        self.local.evict(row)

    def release(self, row: int) -> None:
        self.local.release(row)

    # -- forwards: on every rank -----------------------------------------------------------------------------------

    def step(self, prompts: list[PromptRow], decodes: list[DecodeRow]) -> list[Sampled]:
        if not (prompts or decodes):
            return []
        return self._everywhere(Forward(prompts, decodes), lambda: self.local.step(prompts, decodes))

    def chains(self, decodes: list[DecodeRow]) -> bool:
        """Never: each step is finished when `launch` returns."""
        return False

    def launch(self, decodes: list[DecodeRow], hold_sampling: bool = False) -> Launched:
        """The step computed at once (`chains` is False, so no sampling is ever held)."""
        return self._everywhere(Forward([], decodes), lambda: self.local.launch(decodes))

    def sample_held(self, launched: Launched) -> None:
        """Nothing: no step is launched with its sampling held."""

    def collect(self, launched: Launched) -> list[Sampled]:
        return self.local.collect(launched)

    def _everywhere(self, forward: Forward, compute: Callable[[], _T]) -> _T:
        """The forward sent to the other ranks, then computed here. Any failure stops the worker (DeviceFault): a rank
        that is gone, or a forward that failed here part way, which leaves the ranks' all-reduces out of step."""
        try:
            self.ranks.send(forward)
            return compute()
        except DeviceFault:
            raise
        except Exception as exc:  # a rank that died fails the collective it was in: say which
            out_of_step = f"a forward failed on rank 0, which leaves the ranks out of step: {exc}"
            raise DeviceFault(self.ranks.lost(LOST_WAIT_S) or out_of_step) from exc

    # -- the rest --------------------------------------------------------------------------------------------------

    def fault(self, error: BaseException) -> str | None:
        if isinstance(error, DeviceFault):
            return str(error)
        return self.ranks.lost() or self.local.fault(error)

    def kv_bytes(self) -> int:
        """Rank 0's KV cache (each rank holds as much, for its own key/value heads)."""
        return self.local.kv_bytes()

    def memory_bytes(self) -> int:
        """Rank 0's memory (each other rank holds about as much: its shard, the replicated embedding and LM head)."""
        return self.local.memory_bytes()

    def close(self) -> None:
        self.local.close()


class FollowerRunner(TorchRunner):
    """A rank's runner beyond rank 0: rank 0's forwards over this rank's shard, through the decoder layers only. The
    final norm, the LM head (replicated, so rank 0's logits are the same) and the sampler are rank 0's alone."""

    def run(self, forward: Forward) -> None:
        """Compute one of rank 0's forwards (its all-reduces pair with every other rank's)."""
        if forward.prompts:
            self.prompts(forward.prompts)
        elif forward.decodes:
            self.decodes(forward.decodes)

    def prompts(self, rows: list[PromptRow]) -> None:
        self._prompt_forward(rows)

    def decodes(self, rows: list[DecodeRow]) -> None:
        self._decode_step(rows)

    def _forward(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, mask: torch.Tensor, **paged: torch.Tensor
    ) -> torch.Tensor:
        """The decoder layers' forward (what carries the all-reduces); the last position's hidden state of each row,
        which nobody reads."""
        output = self.model.get_decoder()(
            input_ids=input_ids,
            position_ids=position_ids.clamp(min=0),
            attention_mask=mask,
            use_cache=True,
            **{self.cache_kwarg: self.cache},
            **paged,
        )
        return output.last_hidden_state[:, -1]


def _free_port() -> int:
    """A TCP port free now on the loopback interface, for the rendezvous."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
