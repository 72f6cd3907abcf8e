"""`rbee-worker serve`: its flags checked (usage errors before anything loads), the worker's settings resolved from
them once (`resolve`), and the serving started with them: HTTP on node 0, only the ranks on a node of a higher
--node-rank."""

import argparse
import logging
import os
import signal
from pathlib import Path
from typing import TYPE_CHECKING

from rbee_worker.cli.exits import EXIT_USAGE, exit_at_once, fail
from rbee_worker.cli.model_flags import check_runtime_flags, compile_model, resolve_model

if TYPE_CHECKING:  # devices imports torch, which the CLI imports only once it needs it
    from rbee_worker.engine.engine_config import EngineConfig
    from rbee_worker.hardware.devices import Placement
    from rbee_worker.loading.spec import ModelSpec
    from rbee_worker.server.worker_config import WorkerConfig

log = logging.getLogger("rbee_worker")

DEFAULT_MASTER_PORT = 29500  # torchrun's, for --nnodes above 1 without --master-port


def run_serve(args: argparse.Namespace) -> int:
    from rbee_worker.server.listener import bind, is_loopback

    check_runtime_flags(args)
    check_nodes(args)
    if args.node_rank > 0:
        return run_node(args)
    token = os.environ.get("LLORCH_API_TOKEN") or None
    if token is None and not is_loopback(args.host) and not args.allow_unauthenticated:
        fail(
            f"--host {args.host} exposes the worker beyond this machine: set LLORCH_API_TOKEN (or pass "
            "--allow-unauthenticated)",
            EXIT_USAGE,
        )
    chat_template = read_chat_template(args.chat_template) if args.chat_template else None
    sock = bind(args.host, args.port)  # before the heavy imports below: a taken port fails in well under a second
    # Until serve() installs its drain, a stop signal (nothing runs yet) simply ends the process with success. Not
    # through SystemExit: raised in the middle of an import, transformers' lazy modules turn it into an import error.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: exit_at_once(0))
    from rbee_worker.server.worker import serve

    serve(resolve(args, token, chat_template), sock)
    # Nothing is left to clean up, and the interpreter's finalization (torch's and llama.cpp's modules) takes a while,
    # during which it restores the default signal handlers: a second Ctrl-C then would kill the process.
    exit_at_once(0)


def resolve(args: argparse.Namespace, token: str | None = None, chat_template: str | None = None) -> "WorkerConfig":
    """The worker's settings from `serve`'s flags, each resolved and checked once, before anything loads (one-line
    usage errors, exit 2): this node's placement and --devices, the model probed once (cli/model_flags.py resolve_model:
    its path, format, runtime and quantization), under --tensor-parallel what it cannot split or run, and the engine's
    settings. On a node of a higher --node-rank, what its ranks read."""
    from rbee_worker.engine.parallel.tp_messages import Topology
    from rbee_worker.server.worker_config import WorkerConfig

    placement, devices = serve_placement(args)
    master_port = args.master_port or (DEFAULT_MASTER_PORT if args.nnodes > 1 else None)
    topology = Topology(args.tensor_parallel, args.nnodes, args.node_rank, devices, args.master_addr, master_port)
    model = resolve_model(args, placement, args.max_context, chat_template)
    if topology.world > 1:
        check_tensor_parallel(args, model)
    return WorkerConfig(
        engine=engine_config(args, placement),
        model=model,
        host=args.host,
        api_token=token,
        model_ref=args.model_ref,
        served_model_names=tuple(args.served_model_name),
        access_log=args.access_log,
        max_request_bytes=args.max_request_bytes,
        drain_timeout_s=args.drain_timeout,
        stall_timeout_s=args.stall_timeout,
        unclaimed_job_timeout_s=args.unclaimed_job_timeout,
        worker_id=args.worker_id,
        callback_url=args.callback_url,
        callback_timeout_s=args.callback_timeout,
        heartbeat_url=args.heartbeat_url,
        heartbeat_interval_s=args.heartbeat_interval,
        topology=topology,
        log_level=args.log_level,
        log_format=args.log_format,
    )


def check_nodes(args: argparse.Namespace) -> None:
    """--nnodes / --node-rank against --tensor-parallel: usage errors before anything starts."""
    world, nnodes = args.tensor_parallel, args.nnodes
    if world % nnodes:
        fail(
            f"--tensor-parallel {world} does not spread evenly over --nnodes {nnodes}: --tensor-parallel counts the "
            "ranks of all nodes, and must be a multiple of --nnodes",
            EXIT_USAGE,
        )
    if args.node_rank >= nnodes:
        fail(f"--node-rank {args.node_rank} is not below --nnodes {nnodes}: nodes are 0..{nnodes - 1}", EXIT_USAGE)


def serve_placement(args: argparse.Namespace) -> "tuple[Placement, tuple[int, ...] | None]":
    """This node's first rank's placement and --devices, checked (one-line usage errors, exit 2): --devices names
    CUDA devices the machine has, one per rank on this node; with it, the first rank runs on the first of them."""
    from rbee_worker.hardware.devices import Placement, resolve_placement

    placement = resolve_placement(args.device, args.dtype, args.backend, args.cuda_device)
    if args.devices is None:
        return placement, None
    import torch

    from rbee_worker.engine.parallel.tp_messages import check_devices, parse_devices

    try:
        devices = parse_devices(args.devices)
        count = torch.cuda.device_count() if placement.device.type == "cuda" else 0
        check_devices(devices, args.tensor_parallel // args.nnodes, placement.device.type, count)
    except ValueError as exc:
        fail(str(exc), EXIT_USAGE)
    return Placement(torch.device("cuda", devices[0]), placement.dtype), devices


def run_node(args: argparse.Namespace) -> int:
    """`serve --node-rank R` (R > 0): this node's ranks of a worker whose node 0 serves HTTP; no port is bound. It
    returns (exit 0) once node 0 has stopped them, and exits 1 when one of them fails; SIGTERM / SIGINT end them."""
    from rbee_worker.engine.parallel.ranks import start_ranks

    ranks = start_ranks(resolve(args))

    def stop(*_: object) -> None:
        log.info("node %d: stopping its ranks", args.node_rank)
        ranks.kill()
        exit_at_once(0)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, stop)
    code = ranks.wait()
    if code == 0:
        log.info("node %d: its ranks have stopped with node 0", args.node_rank)
    exit_at_once(code)


def check_tensor_parallel(args: argparse.Namespace, model: "ModelSpec") -> None:
    """--tensor-parallel N with what this version cannot split or run is a usage error, before any process starts:
    a device other than the CPU or CUDA GPUs, --compile, and a model that does not split N ways (its attention heads
    or intermediate size do not divide by N, or its key/value heads neither divide by N nor into it: read from its
    config, without its weights). An int4 layer that a split would cut inside a group is refused by the ranks'
    load (loading/sharding/tp_cuts.py), once its types are known."""
    from rbee_worker.loading.loader import read_model_config
    from rbee_worker.loading.sharding.tp_layers import check_divisible

    world, device, per_node = args.tensor_parallel, model.placement.device, args.tensor_parallel // args.nnodes
    if device.type not in ("cpu", "cuda"):
        fail(f"--tensor-parallel runs on the CPU or CUDA GPUs, not on {device}: use --device cpu", EXIT_USAGE)
    if device.type == "cuda" and args.devices is None:  # --devices is checked against the machine in serve_placement
        import torch

        if (device.index or 0) + per_node > torch.cuda.device_count():
            fail(
                f"--tensor-parallel {world} needs {per_node} GPUs on this node from {device}: this machine has fewer "
                "(or name them with --devices)",
                EXIT_USAGE,
            )
    if args.compile:
        fail("--compile cannot go with --tensor-parallel in this version: drop --compile", EXIT_USAGE)
    config, name = read_model_config(model)
    check_divisible(config, world, name)  # a ModelLoadError: exit 2


def engine_config(args: argparse.Namespace, placement: "Placement") -> "EngineConfig":
    """The engine's settings from `serve`'s flags; under --tensor-parallel N on a CPU, each process's threads are the
    default threads (engine/engine_config.py default_threads) / the ranks on this node (N / --nnodes) unless --threads
    is given."""
    from rbee_worker.engine.engine_config import EngineConfig, default_threads

    threads = args.threads
    world = getattr(args, "tensor_parallel", 1) // getattr(args, "nnodes", 1)  # the processes on this node
    if threads is None and world > 1 and placement.device.type == "cpu":
        threads = max(1, default_threads() // world)
    return EngineConfig(
        deterministic=args.deterministic,
        max_batch=args.max_batch,
        max_queue=args.max_queue,
        kv_cache_bytes=None if args.kv_cache_gb is None else int(args.kv_cache_gb * 2**30),
        prompt_cache_bytes=None if args.cache_ram is None else int(args.cache_ram * 2**30),
        block_size=args.block_size,
        prefix_caching=args.prefix_cache,
        cuda_graphs=args.cuda_graphs,
        compile_model=compile_model(placement, args),
        threads=threads,
        reasoning_parser=args.reasoning_parser,
        grammar_compile_timeout_s=args.grammar_compile_timeout,
    )


def read_chat_template(value: str) -> str:
    """--chat-template: a file's text, or the template itself; checked to be valid Jinja before anything loads."""
    import jinja2

    path = Path(value).expanduser()
    try:
        template = path.read_text(encoding="utf-8") if path.is_file() else value
    except (OSError, UnicodeDecodeError) as exc:
        fail(f"cannot read --chat-template {value}: {exc}", EXIT_USAGE)
    try:
        jinja2.Environment().parse(template)
    except jinja2.TemplateSyntaxError as exc:
        fail(f"--chat-template is not a valid Jinja template (line {exc.lineno}: {exc.message})", EXIT_USAGE)
    return template
