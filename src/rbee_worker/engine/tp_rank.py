"""A tensor-parallel rank beyond rank 0: `python -m rbee_worker.engine.tp_rank`, started by rank 0's Ranks
(engine/tensor_parallel.py), never by hand.

It reads its RankSetup from stdin, joins the ranks' process group, loads the model and cuts its shard, then takes the
RunnerSetup (the engine's settings and the KV pool's geometry, as rank 0 decided them) and runs each Forward that
rank 0 sends down the pipe over its shard, until the pipe closes (rank 0 has stopped: this rank exits 0). It never
samples and keeps no request state: rank 0 does. It exits too when its parent process is gone (killed, say) while it
loads or computes, so that no rank outlives the worker. It ignores SIGINT and SIGTERM, which a terminal or a
supervisor sends to every process of the group: rank 0 drains on them, then ends the other ranks.

--rank and --world on the command line are for `ps` only; the setup on stdin is what counts.
"""

import logging
import os
import pickle
import signal
import sys
import threading
import time
from typing import BinaryIO

log = logging.getLogger("rbee_worker.tp_rank")

PARENT_POLL_S = 0.25


def main() -> None:
    # First, before the imports that take seconds: a terminal's Ctrl-C, or a supervisor's SIGTERM to the whole process
    # group (systemd's default), reaches every rank; rank 0 drains, then closes this rank's pipe.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    import torch

    from rbee_worker.engine.tensor_parallel import FollowerRunner, Forward, RankSetup, RunnerSetup, join, load_shard
    from rbee_worker.logs import configure_logging
    from rbee_worker.models.loader import load_model

    pipe = sys.stdin.buffer
    setup: RankSetup = pickle.load(pipe)
    # Rank 0 speaks for the worker; the other ranks say only what goes wrong (everything when debugging).
    configure_logging("debug" if setup.log_level == "debug" else "warning", setup.log_format)
    _exit_with_parent()
    if setup.threads is not None:
        torch.set_num_threads(setup.threads)

    def load():
        placement = setup.placement
        return load_model(setup.model, placement, None, setup.max_context, None, setup.quantize, "torch")

    try:
        join(setup.rank, setup.world, setup.init_method, setup.placement)
    except Exception:  # rank 0 waits for this rank to join: its watcher sees the exit and stops the worker
        log.exception("tensor-parallel rank %d could not join rank 0", setup.rank)
        os._exit(1)
    try:
        loaded = load_shard(setup.rank, setup.world, load)
    except Exception:  # rank 0 heard of it (load_shard) and reports it: wait for it to close the pipe
        log.debug("rank %d: the load failed", setup.rank, exc_info=True)
        _read_to_end(pipe)
        os._exit(2)
    try:
        runner_setup: RunnerSetup = pickle.load(pipe)
    except EOFError:  # rank 0 stopped before it made its runner
        os._exit(0)
    runner = FollowerRunner(loaded, runner_setup.config, runner_setup.kv)
    try:
        with torch.inference_mode():
            while True:
                try:
                    forward: Forward = pickle.load(pipe)
                except EOFError:
                    break
                runner.run(forward)
    except Exception:
        log.exception("tensor-parallel rank %d failed; it stops (and with it the worker)", setup.rank)
        os._exit(1)
    # os._exit: nothing to clean up, and the process group's teardown could wait on ranks that are gone.
    os._exit(0)


def _exit_with_parent() -> None:
    """A thread that ends this process once its parent (rank 0) is gone, whatever this one is doing."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_POLL_S)
        os._exit(1)

    threading.Thread(target=watch, name="rbee-parent-watch", daemon=True).start()


def _read_to_end(pipe: BinaryIO) -> None:
    while pipe.read(1 << 16):
        pass


if __name__ == "__main__":
    main()
