"""A tensor-parallel rank beyond rank 0: `python -m rbee_worker.engine.parallel.rank_process`, started by its node's
Ranks (engine/parallel/ranks.py: rank 0's process on node 0, `serve --node-rank R` on another node), never by hand.

It reads its RankSetup from stdin, joins the ranks' process group (and the control group), starts its heartbeat
(engine/parallel/rank_group.py: a counter in rank 0's rendezvous store, which also ends this rank once rank 0 is gone),
loads the model and cuts its shard, then takes the RunnerSetup (the engine's settings and the KV pool's geometry, as
rank 0 decided them), makes its runner, tells every rank its weights and memory (one gather), and runs each ForwardRows
that rank 0 sends over its shard. A rank on node 0 reads them from its pipe, until the pipe closes; a rank on another
node receives them on the control group, until rank 0's Stop. Either way rank 0 has stopped and this rank exits 0; a
broadcast that fails or times out (rank 0 gone, or silent past CONTROL_TIMEOUT) makes it exit 1. It never samples
and keeps no request state: rank 0 does. It exits too when its parent process is gone (killed, say) while it loads or
computes, so that no rank outlives the worker. It ignores SIGINT and SIGTERM, which a terminal or a supervisor sends
to every process of the group: rank 0 drains on them, then ends the other ranks.

--rank and --world on the command line are for `ps` only; the setup on stdin is what counts.
"""

import contextlib
import logging
import os
import pickle
import signal
import sys
import threading
import time

log = logging.getLogger("rbee_worker.tp_rank")

PARENT_POLL_S = 0.25


def main() -> None:
    # First, before the imports that take seconds: a terminal's Ctrl-C, or a supervisor's SIGTERM to the whole process
    # group (systemd's default), reaches every rank; rank 0 drains, then closes this rank's pipe.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    import torch

    from rbee_worker.engine.parallel.rank_group import control_group, join, load_shard, receive, start_beating
    from rbee_worker.engine.parallel.tp_messages import ForwardRows, Ping, RankSetup, RunnerSetup, Stop
    from rbee_worker.engine.parallel.tp_runners import FollowerRunner, runner_reports
    from rbee_worker.loading.loader import load_spec
    from rbee_worker.logs import configure_logging

    pipe = sys.stdin.buffer
    setup: RankSetup = pickle.load(pipe)
    rank, topology, placement = setup.rank, setup.topology, setup.model.placement
    # Rank 0 speaks for the worker; the other ranks say only what goes wrong (everything when debugging).
    configure_logging("debug" if setup.log_level == "debug" else "warning", setup.log_format)
    _exit_with_parent()
    if setup.threads is not None:
        torch.set_num_threads(setup.threads)
    try:
        join(rank, topology.world, topology.init_method, placement)
        start_beating(rank)
        group = control_group(topology.world, topology.per_node)
    except Exception:  # rank 0 waits for this rank to join: its watcher sees the exit and stops the worker
        log.exception("tensor-parallel rank %d could not join rank 0", rank)
        os._exit(1)

    def next_message() -> object:
        """Rank 0's next message: from the control group on another node, else from the pipe (its end: Stop)."""
        if group is not None and topology.remote(rank):
            return receive(group)
        try:
            return pickle.load(pipe)
        except EOFError:
            return Stop()

    try:
        loaded, _ = load_shard(rank, topology.world, lambda: load_spec(setup.model), str(placement.device))
    except Exception:  # rank 0 heard of it (load_shard) and reports it: wait for it to stop
        log.debug("rank %d: the load failed", rank, exc_info=True)
        with contextlib.suppress(Exception):
            while not isinstance(next_message(), Stop):
                pass
        os._exit(2)
    try:
        runner_setup = next_message()
        if isinstance(runner_setup, Stop):  # rank 0 stopped before it made its runner
            os._exit(0)
        assert isinstance(runner_setup, RunnerSetup), runner_setup
        runner = FollowerRunner(loaded, runner_setup.config, runner_setup.kv)
        runner_reports(topology.world, runner, str(placement.device))
        with torch.inference_mode():
            while not isinstance(message := next_message(), Stop):
                if isinstance(message, ForwardRows):
                    runner.run(message)
                else:
                    assert isinstance(message, Ping), message
    except Exception:
        log.exception("tensor-parallel rank %d failed or lost rank 0; it stops (and with it the worker)", rank)
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


if __name__ == "__main__":
    main()
