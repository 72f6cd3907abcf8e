"""Tensor parallelism's processes: one `serve` runs a model split over N ranks (loading/sharding/tp_layers.py), rank 0
in its own process (HTTP, the scheduler, the sampler) and the other ranks of its node in processes that it starts itself
(engine/parallel/rank_process.py, each with a FollowerRunner), joined by torch.distributed: gloo on CPUs, NCCL on CUDA
GPUs. Where the ranks run and the messages that cross between them are engine/parallel/tp_messages.py's; rank 0's runner
and the other ranks' runner are engine/parallel/tp_runners.py's.

Nodes: node 0's rank 0 hosts the rendezvous. Node 0 runs rank 0 and its local ranks; every other node runs
`serve ... --node-rank R`, which binds no HTTP port and only starts and watches its ranks (`Ranks.wait`).

Every rank runs the same forwards over its shard in the same order, so that their all-reduces pair up: rank 0's
runner (TensorParallelRunner: the Runner protocol of engine/runners/protocol.py around rank 0's own TorchRunner) sends
each forward's rows (a ForwardRows, pickled) to the other ranks before it computes the forward itself. Ranks on node 0
read them from their stdin pipe: a pipe needs no timeout while the worker idles, and a rank whose rank 0 has died reads
the end of it. Ranks on other nodes, which no pipe reaches, receive them through a broadcast over a gloo process group
of their own (the control group: rank 0 and the other nodes' ranks, gloo even where the forwards' group is NCCL). The
pipe stays for node 0's ranks because it is the cheaper of the two: a forward's message and one all-reduce take about
a millisecond less over a pipe than over the broadcast with 2 ranks, and about three with 3 (bench/results/README.md,
"tensor parallel control messages"). On the control group rank 0 also sends a Ping every PING_S while it has nothing
else to send, so that a rank on another node tells an idle rank 0 (a Ping within CONTROL_TIMEOUT) from one that is
gone (a failed or timed-out broadcast), and a Stop when it stops. A forward's message and the forward itself hold one
lock, so that a Ping is only broadcast while every rank waits on the control group.

What rank 0 reports for all ranks (/health, the ready callback, /metrics): each rank's device, weight bytes and
memory, gathered once when every rank has made its runner (`runner_reports`); a rank's KV cache is as large as rank
0's, since every rank holds the same number of blocks of as many key/value heads.

Faults: a rank on rank 0's node that exits is seen within a fraction of a second (Ranks' watcher, polling the
processes); a rank on another node fails the next Ping (at most PING_S later while idle) or the forward's collective
it was in (gloo sees the closed connection at once). A rank that stops without closing anything (a stopped process,
a host cut off, a hang), which would leave rank 0 in a collective until GROUP_TIMEOUT, misses its heartbeats: every
rank beyond 0 adds to a counter in the rendezvous store every BEAT_S from a thread of its own, which runs while the
rank computes or waits in a collective, and Ranks' watcher takes a counter that stands still for BEAT_TIMEOUT_S for a
lost rank. However it is seen, the worker stops (server.rank_failed: through the engine, or at once if the engine
itself is stuck in a collective); a forward that fails on rank 0 leaves the ranks' collectives out of step, so it
stops the worker too (DeviceFault). The other ranks end with rank 0: its pipe closes or its Stop arrives (or its
broadcast fails, or the store, which lives in rank 0's process, stops answering their beats), and each also watches
its parent process.

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
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist

from rbee_worker.engine.parallel.rank_group import PING_S, Beats, control_group, first_line, join, load_shard
from rbee_worker.engine.parallel.tp_messages import Ping, RankReport, RankSetup, Stop, Topology, rank_placement
from rbee_worker.engine.runners.protocol import DeviceFault
from rbee_worker.loading.loaded import LoadedModel
from rbee_worker.loading.spec import ModelSpec, Shard
from rbee_worker.server.worker_config import WorkerConfig

log = logging.getLogger(__name__)

POLL_S = 0.1  # how often rank 0 looks at its ranks' processes
LOST_WAIT_S = 1.0  # after a failed collective, how long to look for the rank whose exit failed it
CLOSE_S = 5.0  # how long ranks get to exit once their pipe is closed, before they are killed


class Ranks:
    """This node's ranks beyond rank 0 as child processes of this one, each given its RankSetup through its stdin pipe
    (and, on node 0, every forward after it); started at once, so that they load while rank 0 loads. On node 0 this
    process is rank 0 (`load`, `runner`, `send`); on another node it only starts and watches its ranks (`wait`)."""

    def __init__(self, topology: Topology, config: WorkerConfig) -> None:
        model = self.model = config.model
        self.topology, self.placement, self.threads = topology, model.placement, config.engine.threads
        self.world = topology.world
        self.failure: str | None = None  # why a rank stopped, once one has
        self.reports: list[RankReport] = []  # every rank's, once loaded (rank 0)
        self.group: dist.ProcessGroup | None = None  # the control group (rank 0, several nodes)
        self._closing = threading.Event()
        self._lock = threading.Lock()  # one message (and its forward) at a time
        self._last_sent = time.monotonic()
        self._on_failure: Callable[[str], None] | None = None
        self._failing = threading.Lock()  # `failure` is set from the watcher, the Ping thread and the engine thread
        self._memory_bytes: Callable[[], list[int]] | None = None  # set by `serving`
        self.processes: dict[int, subprocess.Popen[bytes]] = {}  # by global rank
        first = topology.first
        for rank in range(max(first, 1), first + topology.per_node):
            placement = rank_placement(model.placement, rank - first, topology.devices)
            own = dataclasses.replace(model, placement=placement, shard=Shard(rank, self.world))
            setup = RankSetup(rank, topology, own, self.threads, config.log_level, config.log_format)
            command = [
                sys.executable,
                "-m",
                "rbee_worker.engine.parallel.rank_process",
                f"--rank={rank}",
                f"--world={self.world}",
            ]
            process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL)
            self.processes[rank] = process
            self._write(process, pickle.dumps(setup))
        pids = [p.pid for p in self.processes.values()]
        log.info(
            "tensor parallel: %d ranks on %d node(s), this node's ranks %d..%d, in processes %s",
            self.world,
            topology.nnodes,
            first,
            first + topology.per_node - 1,
            ", ".join(map(str, pids)) or "none",
            extra={"fields": {"tensor_parallel": self.world, "node_rank": topology.node_rank, "rank_pids": pids}},
        )

    @property
    def devices(self) -> list[str]:
        """Every rank's device, in rank order (after the load)."""
        return [report.device for report in self.reports]

    def load(self, load: Callable[[ModelSpec], LoadedModel]) -> LoadedModel:
        """Rank 0's load (on the engine thread): join the other ranks, load rank 0's shard (`load` given the worker's
        ModelSpec with that shard)."""
        if self.threads is not None:
            torch.set_num_threads(self.threads)
        join(0, self.world, self.topology.init_method, self.placement)
        self.group = control_group(self.world, self.topology.per_node)
        spec = dataclasses.replace(self.model, shard=Shard(0, self.world))
        loaded, self.reports = load_shard(0, self.world, lambda: load(spec), str(self.placement.device))
        return loaded

    def serving(self, memory_bytes: Callable[[], list[int]]) -> None:
        """Rank 0's runner exists (tensor_parallel.runner_factory): every rank's memory comes from `memory_bytes`, the
        ranks' heartbeats are checked from now on, and the control group's Pings start."""
        self._memory_bytes = memory_bytes
        if self.group is not None:
            threading.Thread(target=self._ping, name="rbee-ranks-ping", daemon=True).start()

    def memory_bytes(self) -> list[int]:
        """Each rank's memory bytes, in rank order, once the runner exists (TensorParallelRunner.rank_memory_bytes)."""
        return [] if self._memory_bytes is None else self._memory_bytes()

    @contextlib.contextmanager
    def turn(self) -> Iterator[None]:
        """Hold the ranks for one message and the forward that follows it (no Ping goes out meanwhile)."""
        with self._lock:
            yield

    def send(self, message: object) -> None:
        """One message to every other rank (inside `turn`); raises DeviceFault when a rank cannot take it."""
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        for rank, process in self.processes.items():
            try:
                self._write(process, data)
            except (BrokenPipeError, ValueError, OSError) as exc:
                reason = self.lost(LOST_WAIT_S) or f"tensor-parallel rank {rank} (pid {process.pid}) has exited"
                raise DeviceFault(reason) from exc
        if self.group is not None:
            try:
                dist.broadcast_object_list([message], src=0, group=self.group)
            except Exception as exc:  # a rank on another node is gone (its connection closed) or silent
                reason = f"a tensor-parallel rank on another node is gone: {first_line(exc)}"
                with self._failing:  # the watcher reports it (not this thread, which holds the ranks)
                    self.failure = self.failure or reason
                raise DeviceFault(self.failure) from exc
        self._last_sent = time.monotonic()

    def watch(self, on_failure: Callable[[str], None]) -> None:
        """Call `on_failure(reason)` once, from a thread of its own, when a rank exits before `close` (a rank on this
        node: seen by polling its process; on another node: by a failed Ping)."""
        self._on_failure = on_failure

        def poll() -> None:
            beats: Beats | None = None
            while not self._closing.is_set():
                # Every rank beats from its join; checked once rank 0 serves.
                if beats is None and self._memory_bytes is not None:
                    beats = Beats(self.world)
                if (reason := self.lost() or (beats and beats.silent())) is not None:  # also one another thread set
                    self._fail(reason)
                    return
                time.sleep(POLL_S)

        threading.Thread(target=poll, name="rbee-ranks", daemon=True).start()

    def _fail(self, reason: str) -> None:
        """Record why the ranks broke (the first reason stays) and tell the watcher, once, unless they are closing."""
        with self._failing:
            failure = self.failure = self.failure or reason
            callback, self._on_failure = self._on_failure, None
        if callback is not None and not self._closing.is_set():
            callback(failure)

    def _ping(self) -> None:
        """Rank 0's Pings on the control group, every PING_S that nothing else went out (see the module)."""
        while not self._closing.is_set() and self.failure is None:
            time.sleep(PING_S / 4)
            if time.monotonic() - self._last_sent < PING_S or not self._lock.acquire(blocking=False):
                continue
            try:
                if not self._closing.is_set():
                    self.send(Ping())
            except DeviceFault:
                return  # recorded in `failure`: the watcher reports it
            finally:
                self._lock.release()

    def lost(self, wait_s: float = 0.0) -> str | None:
        """Which rank has exited and how (kept in `failure`), looking for up to `wait_s` seconds; None: none has."""
        deadline = time.monotonic() + wait_s
        while self.failure is None:
            for rank, process in self.processes.items():
                if (code := process.poll()) is not None:
                    how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
                    self.failure = f"tensor-parallel rank {rank} (pid {process.pid}) {how}"
                    break
            else:
                if time.monotonic() >= deadline:
                    return None
                time.sleep(POLL_S / 2)
        return self.failure

    def wait(self) -> int:
        """On a node beyond 0: wait for this node's ranks. 0 once they have all exited 0 (rank 0's Stop); 1 as soon
        as one fails, the others killed, the reason logged and printed."""
        while True:
            codes = {rank: process.poll() for rank, process in self.processes.items()}
            if failed := [(rank, code) for rank, code in codes.items() if code not in (None, 0)]:
                rank, code = failed[0]
                how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
                reason = f"tensor-parallel rank {rank} (pid {self.processes[rank].pid}) {how}"
                self.kill()
                log.error("node %d stops: %s", self.topology.node_rank, reason)
                print(f"error: node {self.topology.node_rank} stops: {reason}", file=sys.stderr, flush=True)
                return 1
            if all(code == 0 for code in codes.values()):
                return 0
            time.sleep(POLL_S)

    def kill(self) -> None:
        """End this node's ranks at once (they ignore SIGTERM: see engine/parallel/rank_process.py)."""
        self._closing.set()
        for process in self.processes.values():
            if process.poll() is None:
                process.kill()
            process.wait()

    def close(self, timeout_s: float = CLOSE_S) -> None:
        """End every other rank: a Stop on the control group (unless a rank is already lost: then rank 0's exit ends
        the other nodes' ranks), their pipes closed (each then exits), and the ones still there after `timeout_s`
        are killed. Safe to call more than once, from any thread."""
        already = self._closing.is_set()
        self._closing.set()
        if self.group is not None and self.failure is None and not already:
            stopping = threading.Thread(target=self._stop_remote, name="rbee-ranks-stop", daemon=True)
            stopping.start()
            stopping.join(max(timeout_s, POLL_S))
        for process in self.processes.values():
            if process.stdin is not None:
                with contextlib.suppress(OSError):  # a rank that is gone
                    process.stdin.close()
        deadline = time.monotonic() + timeout_s
        for process in self.processes.values():
            try:
                process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()

    def _stop_remote(self) -> None:
        """The Stop broadcast, once the forward that runs (if any) is over."""
        with self._lock, contextlib.suppress(Exception):  # a rank gone meanwhile: rank 0's exit ends the others
            dist.broadcast_object_list([Stop()], src=0, group=self.group)

    @staticmethod
    def _write(process: subprocess.Popen[bytes], data: bytes) -> None:
        assert process.stdin is not None
        process.stdin.write(data)
        process.stdin.flush()


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free now on `host` (an address of this machine), for the rendezvous on one node."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def start_ranks(config: WorkerConfig) -> Ranks:
    """Under --tensor-parallel N: this node's ranks beyond rank 0 started now, so that they load while this process
    loads (node 0: it is rank 0) or watches them (another node); every node's ranks join at the rendezvous,
    --master-port or a free port on one node."""
    topology = config.topology
    if topology.master_port is None:
        topology = dataclasses.replace(topology, master_port=free_port(topology.master_addr))
    return Ranks(topology, config)
