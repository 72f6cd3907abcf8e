"""What every tensor-parallel rank does to take part (engine/parallel/ranks.py says how the ranks run): join the
ranks' process group and, across nodes, the control group; beat into the rendezvous store so that rank 0 can tell a
rank that stopped from one that computes (rank 0 reads the beats: `Beats`); receive rank 0's messages on the control
group; and load its shard, every rank learning whether every other one loaded."""

import logging
import os
import threading
import time
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

from rbee_worker.engine.parallel.tp_messages import RankReport
from rbee_worker.errors import ModelLoadError
from rbee_worker.hardware.devices import Placement
from rbee_worker.loading.loaded import LoadedModel
from rbee_worker.loading.sharding.tp_layers import shard_loaded

log = logging.getLogger(__name__)

# Collectives wait this long for a peer (the one wait that can be long: every rank's load, before the first gather).
GROUP_TIMEOUT = timedelta(minutes=30)
PING_S = 1.0  # how long rank 0 leaves the control group without a message
# How long a rank on another node waits on the control group before it takes rank 0 for gone (a host that vanished
# without closing its connections); a Ping comes every PING_S while rank 0 is idle.
CONTROL_TIMEOUT = timedelta(seconds=30)
# Every rank beyond 0 adds 1 to its counter in the rendezvous store (hosted by rank 0) every BEAT_S, from a thread of
# its own, so that it beats while it computes or waits in a collective; rank 0 takes a rank whose counter has not
# moved for BEAT_TIMEOUT_S for lost (a stopped process, a host gone without closing its connections).
BEAT_S = 1.0
BEAT_TIMEOUT_S = 10.0


def join(rank: int, world: int, init_method: str, placement: Placement) -> None:
    """Join the ranks' process group: gloo on a CPU, NCCL on CUDA (this rank's GPU made the current one)."""
    device = placement.device
    if device.type == "cuda":  # untested: no GPU on the machine this slice was written on
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world, timeout=GROUP_TIMEOUT)


def control_group(world: int, per_node: int) -> dist.ProcessGroup | None:
    """The control group (after `join`, on every rank, since making a group is collective): rank 0 and the ranks of
    the other nodes, over gloo; None on one node."""
    if per_node == world:
        return None
    return dist.new_group([0, *range(per_node, world)], timeout=CONTROL_TIMEOUT, backend="gloo")


def beat_key(rank: int) -> str:
    return f"rbee/beat/{rank}"


def start_beating(rank: int) -> None:
    """This rank's heartbeat (after `join`): a thread that adds to its counter in the store every BEAT_S, and ends
    the process when the store, which lives in rank 0's process, is gone."""
    store = dist.distributed_c10d._get_default_store()

    def beat() -> None:
        while True:
            try:
                store.add(beat_key(rank), 1)
            except Exception as exc:  # rank 0, and the store with it, is gone
                time.sleep(BEAT_S)  # unless it stopped the ranks first (its Stop, or the pipe's end: exit 0)
                log.error("tensor-parallel rank %d lost rank 0 (%s); it stops", rank, first_line(exc))
                os._exit(1)
            time.sleep(BEAT_S)

    threading.Thread(target=beat, name="rbee-rank-beat", daemon=True).start()


class Beats:
    """Rank 0's view of the other ranks' heartbeats: `silent()` names a rank whose counter has not moved for
    BEAT_TIMEOUT_S."""

    def __init__(self, world: int) -> None:
        self.store = dist.distributed_c10d._get_default_store()
        now = time.monotonic()
        self.seen: dict[int, tuple[int, float]] = {rank: (-1, now) for rank in range(1, world)}
        self.checked = 0.0

    def silent(self) -> str | None:
        now = time.monotonic()
        if now - self.checked < BEAT_S:
            return None
        self.checked = now
        for rank, (count, since) in self.seen.items():
            try:
                current = self.store.add(beat_key(rank), 0)
            except Exception:  # the store is rank 0's own: it fails only as the process ends
                return None
            if current != count:
                self.seen[rank] = (current, now)
            elif now - since > BEAT_TIMEOUT_S:
                silence = f"{now - since:.0f} s"
                return f"tensor-parallel rank {rank} has sent no heartbeat for {silence} (stopped, or its host is gone)"
        return None


def receive(group: dist.ProcessGroup) -> object:
    """The next message that rank 0 broadcasts on the control group (raises when rank 0 is gone or silent)."""
    box: list[object] = [None]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


def load_shard(
    rank: int, world: int, load: Callable[[], LoadedModel], device: str
) -> tuple[LoadedModel, list[RankReport]]:
    """Load this rank's shard (after `join`; `load` loads a ModelSpec with this rank's shard: either loader builds it
    alone, loading/sharding/tp_loading.py); every
    rank's report (one gather), in rank order. So every rank learns whether every other one loaded, and a model that
    fails anywhere ends every rank with an error, never a hang in a later collective: this rank's own error is raised as
    it is, another rank's as a ModelLoadError."""
    loaded, error = None, None
    try:
        loaded = shard_loaded(load(), rank, world)
    except Exception as exc:  # reported to every rank below
        error = exc
    own = RankReport(device, error=None if error is None else f"rank {rank} could not load the model: {error}")
    reports: list[RankReport | None] = [None] * world
    dist.all_gather_object(reports, own)
    if error is not None:
        raise error
    if failed := next((report.error for report in reports if report is not None and report.error), None):
        raise ModelLoadError(failed)
    assert loaded is not None and all(report is not None for report in reports)
    return loaded, [report for report in reports if report is not None]


def first_line(exc: BaseException) -> str:
    """An exception's first line (gloo's errors run over many)."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
