"""What the flags pick that depends on the model and device: the runtime (torch or llama.cpp, and the flags only
torch honours), the quantization to load with, and whether the model runs through torch.compile."""

import argparse
import logging
from typing import TYPE_CHECKING

from rbee_worker.cli.exits import EXIT_USAGE, fail

if TYPE_CHECKING:  # devices imports torch, which the CLI imports only once it needs it
    import torch

    from rbee_worker.devices import Placement

log = logging.getLogger("rbee_worker")

# Why the llama.cpp runtime cannot honour a flag that only the torch runtime honours. No flag is honoured by the
# llama.cpp runtime alone: --threads, --deterministic, --max-batch, --max-context, --kv-cache-gb, --block-size,
# --no-prefix-cache and --chat-template apply on both (on llama.cpp, whose memory does not follow the block tables, the
# blocks are accounting only and no prefix is shared), and the CUDA graph flags apply to a CUDA device, where only torch
# runs.
KEEPS_FILE_TYPES = "keeps the GGUF file's types"
NO_TORCH_COMPILE = "runs nothing through torch.compile"
ONE_PROCESS = "runs a model in one process (tensor parallelism runs on the torch runtime)"


def torch_only_flags(args: argparse.Namespace) -> dict[str, str]:
    """The flags given with a value other than their default that only the torch runtime honours, each as written on
    the command line, with why the llama.cpp runtime cannot. A default (`auto`, no --compile) leaves the runtime free;
    --no-compile asks for what the llama.cpp runtime does anyway."""
    given = {}
    if args.dtype != "auto":
        given[f"--dtype {args.dtype}"] = KEEPS_FILE_TYPES
    if args.quantize != "auto":
        given[f"--quantize {args.quantize}"] = KEEPS_FILE_TYPES
    if getattr(args, "compile", None):  # a `serve` flag
        given["--compile"] = NO_TORCH_COMPILE
    if getattr(args, "tensor_parallel", 1) > 1:  # a `serve` flag
        given[f"--tensor-parallel {args.tensor_parallel}"] = ONE_PROCESS
    return given


def check_runtime_flags(args: argparse.Namespace) -> None:
    """`--runtime llama.cpp` with a flag that only the torch runtime honours is a usage error, reported before anything
    loads: such a flag is never ignored in silence."""
    given = torch_only_flags(args)
    if args.runtime != "llama.cpp" or not given:
        return
    by_reason: dict[str, list[str]] = {}
    for flag, why in given.items():
        by_reason.setdefault(why, []).append(flag)
    conflicts = [
        f"--runtime llama.cpp {why}: {' and '.join(flags)} cannot be honoured" for why, flags in by_reason.items()
    ]
    *rest, last = [flag.split()[0] for flag in given]
    names = f"{', '.join(rest)} and {last}" if rest else last
    fail(f"{'; '.join(conflicts)}; drop {names} or use --runtime torch", EXIT_USAGE)


def runtime_for(args: argparse.Namespace, device: "torch.device") -> str:
    """The --runtime to load with: under `auto`, torch where a flag that only torch honours is given, logged with the
    reason where `auto` alone would pick the llama.cpp runtime for this model and device."""
    given = torch_only_flags(args)
    if args.runtime != "auto" or not given:
        return args.runtime
    from rbee_worker.models.loader import auto_runtime, names_gguf

    if auto_runtime(names_gguf(args.model), device) == "llama.cpp":
        reasons = "; ".join(f"{flag} was given and the llama.cpp runtime {why}" for flag, why in given.items())
        log.info("runtime: torch, because %s", reasons)
    return "torch"


def quantize_for(args: argparse.Namespace, placement: "Placement") -> str:
    """The --quantize to load with: under `auto`, an explicit --dtype other than the one the int4 / int8 kernels compute
    in (bfloat16) loads every weight in that dtype (`none`) instead of keeping a GGUF file's quantized matrices, logged
    with the reason for a GGUF file."""
    from rbee_worker.models.dequant import KERNEL_DTYPE
    from rbee_worker.models.loader import names_gguf

    if args.quantize == "auto" and getattr(args, "tensor_parallel", 1) > 1:
        if names_gguf(args.model):
            log.info("quantize: none, because --tensor-parallel keeps quantized weights only with --quantize int4|int8")
        return "none"
    if args.quantize != "auto" or args.dtype == "auto" or placement.dtype == KERNEL_DTYPE:
        return args.quantize
    if names_gguf(args.model):
        kernels = str(KERNEL_DTYPE).removeprefix("torch.")
        log.info(
            "quantize: none, because --dtype %s was given and the int4 / int8 kernels compute in %s",
            args.dtype,
            kernels,
        )
    return "none"


def compile_model(placement: "Placement", args: argparse.Namespace) -> bool:
    """--compile, by default on where the compiled layers run inside CUDA graphs. Outside graphs each compiled frame
    checks its guards on every call, every layer's frames each step, which costs about what the fusion saves
    (bench/results/README.md)."""
    if args.compile is not None:
        return args.compile
    return placement.device.type == "cuda" and args.cuda_graphs and not args.deterministic
