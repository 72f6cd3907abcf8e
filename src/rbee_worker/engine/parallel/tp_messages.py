"""Tensor parallelism's plain data, with no process, group or thread behind it (those are engine/parallel/ranks.py's and
rank_group.py's): where the ranks run and what crosses between them.

Where (torchrun's and vLLM's conventions): --tensor-parallel N is the whole world, spread evenly over --nnodes K
(N / K ranks a node; global rank = node rank x N / K + local rank), joined through torch.distributed's TCP rendezvous
at --master-addr:--master-port (`Topology`). On CUDA, local rank i takes the i-th GPU of --devices (`parse_devices`,
`check_devices`), by default from --device's index upward (`rank_placement`).

What crosses, pickled: a rank beyond 0 first gets its RankSetup (what it needs to load its shard: rank 0's ModelSpec
with its own placement), then the RunnerSetup (the engine's settings and the KV pool's geometry, as rank 0 decided
them), then a ForwardRows for each of rank 0's forwards (the plain PromptRow / DecodeRow dataclasses of
engine/runners/protocol.py); on the control group also a Ping while rank 0 idles and a Stop when it stops. Every rank
tells every other one its RankReport (engine/parallel/rank_group.py's load_shard, engine/parallel/tp_runners.py's
runner_reports).
"""

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from rbee_worker.engine.engine_config import EngineConfig
from rbee_worker.engine.runners.protocol import DecodeRow, KvGeometry, PromptRow
from rbee_worker.hardware.devices import Placement
from rbee_worker.loading.spec import ModelSpec


@dataclass(frozen=True)
class Topology:
    """Where the ranks run: `world` ranks over `nnodes` nodes, `world // nnodes` on each, this process on node
    `node_rank`, joined at node 0's rendezvous, master_addr:master_port (None: a free port, chosen when the ranks
    start, on one node); `devices` the CUDA device index of each local rank (None: from rank 0's device upward). A
    world of 1: no tensor parallelism."""

    world: int = 1
    nnodes: int = 1
    node_rank: int = 0
    devices: tuple[int, ...] | None = None
    master_addr: str = "127.0.0.1"
    master_port: int | None = None

    @property
    def per_node(self) -> int:
        return self.world // self.nnodes

    @property
    def first(self) -> int:
        """This node's first global rank."""
        return self.node_rank * self.per_node

    @property
    def init_method(self) -> str:
        """torch.distributed's rendezvous, tcp://host:port of node 0 (once the port is known)."""
        assert self.master_port is not None, "the rendezvous port is chosen when the ranks start"
        return f"tcp://{self.master_addr}:{self.master_port}"

    def remote(self, rank: int) -> bool:
        """Whether global rank `rank` runs on another node than rank 0 (and so reads the control group)."""
        return rank >= self.per_node


@dataclass(frozen=True)
class RankSetup:
    """What a rank beyond 0 needs to load its shard: the first message down its pipe."""

    rank: int  # global
    topology: Topology  # with its rendezvous port
    model: ModelSpec  # as rank 0 probed it, with this rank's placement
    threads: int | None  # torch's CPU threads
    log_level: str
    log_format: str | None


@dataclass(frozen=True)
class RunnerSetup:
    """The engine's settings and the KV pool's geometry, as rank 0 decided them: the second message."""

    config: EngineConfig
    kv: KvGeometry


@dataclass(frozen=True)
class ForwardRows:
    """One forward's rows, as rank 0 runs it: prompt chunks, or decode rows."""

    prompts: list[PromptRow]
    decodes: list[DecodeRow]


@dataclass(frozen=True)
class Ping:
    """Rank 0 is there and idle (the control group only)."""


@dataclass(frozen=True)
class Stop:
    """Rank 0 stops: the rank exits 0 (the control group only; a pipe closes instead)."""


@dataclass(frozen=True)
class RankReport:
    """What each rank tells every other: once its shard is loaded, its device and its error (`load_shard`); once its
    runner is made, also its weight bytes as prepared for serving and its memory (`runner_reports`)."""

    device: str
    weight_bytes: int = 0
    memory_bytes: int = 0
    error: str | None = None


def parse_devices(text: str) -> tuple[int, ...]:
    """--devices: CUDA device indices, comma separated, each once (`2,3`); ValueError naming what is wrong."""
    parts = [part.strip() for part in text.split(",")]
    if not all(part.isdigit() for part in parts):
        raise ValueError(f"--devices {text}: expected CUDA device indices separated by commas, such as 2,3")
    devices = tuple(int(part) for part in parts)
    if len(set(devices)) != len(devices):
        raise ValueError(f"--devices {text} names a device more than once")
    return devices


def check_devices(devices: tuple[int, ...], per_node: int, device_type: str, device_count: int) -> None:
    """--devices against this node's ranks and the machine: ValueError (a usage error) when they are not CUDA devices,
    when their count is not the ranks on this node, or when the machine lacks one of them."""
    listed = ",".join(map(str, devices))
    if device_type != "cuda":
        raise ValueError(f"--devices {listed} names CUDA GPUs, and this worker runs on {device_type}: drop --devices")
    if len(devices) != per_node:
        raise ValueError(
            f"--devices {listed} names {len(devices)} GPU(s) for {per_node} rank(s) on this node "
            "(--tensor-parallel / --nnodes): give one device per rank"
        )
    if missing := [index for index in devices if index >= device_count]:
        raise ValueError(f"--devices {listed}: this machine has {device_count} CUDA device(s), so no cuda:{missing[0]}")


def rank_placement(placement: Placement, local_rank: int, devices: Sequence[int] | None = None) -> Placement:
    """Local rank `local_rank`'s device: on CUDA the local_rank-th of `devices`, or without them the local_rank-th GPU
    from rank 0's; elsewhere the same device."""
    if placement.device.type != "cuda":
        return placement
    index = devices[local_rank] if devices else (placement.device.index or 0) + local_rank
    return Placement(torch.device("cuda", index), placement.dtype)
