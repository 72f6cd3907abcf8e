"""What the flags pick that depends on the model and device: the model probed with the runtime (torch or llama.cpp,
and the flags only torch honours) and the quantization to load with, and whether the model runs through
torch.compile."""

import argparse
import logging
from typing import TYPE_CHECKING

from rbee_worker.cli.exits import EXIT_USAGE, fail

if TYPE_CHECKING:  # devices imports torch, which the CLI imports only once it needs it
    from rbee_worker.hardware.devices import Placement
    from rbee_worker.loading.spec import ModelSpec

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


def resolve_model(
    args: argparse.Namespace,
    placement: "Placement",
    max_context: int | None = None,
    chat_template: str | None = None,
) -> "ModelSpec":
    """MODEL as the flags ask for it, probed once (loading/loader.py probe_model: its path and format, the runtime,
    never `auto`, and the quantization it loads with). Under --runtime auto, a flag that only torch honours picks
    torch; under --quantize auto, --tensor-parallel or an explicit --dtype other than the one the int4 / int8 kernels
    compute in (bfloat16) loads every weight in that dtype (`none`) instead of keeping a GGUF file's quantized
    matrices. Each such choice is logged with its reason where it changes what `auto` alone picks for this model."""
    from rbee_worker.loading.gguf.dequant import KERNEL_DTYPE
    from rbee_worker.loading.loader import auto_runtime, probe_model

    given = torch_only_flags(args)
    runtime = "torch" if args.runtime == "auto" and given else args.runtime
    tensor_parallel = getattr(args, "tensor_parallel", 1) > 1  # a `serve` flag
    explicit_dtype = args.dtype != "auto" and placement.dtype != KERNEL_DTYPE
    float_weights = args.quantize == "auto" and (tensor_parallel or explicit_dtype)
    quantize = "none" if float_weights else args.quantize
    spec = probe_model(
        args.model, placement, runtime=runtime, quantize=quantize, max_context=max_context, chat_template=chat_template
    )
    if runtime != args.runtime and auto_runtime(spec.gguf, placement.device) == "llama.cpp":
        reasons = "; ".join(f"{flag} was given and the llama.cpp runtime {why}" for flag, why in given.items())
        log.info("runtime: torch, because %s", reasons)
    if float_weights and spec.gguf and tensor_parallel:
        log.info("quantize: none, because --tensor-parallel keeps quantized weights only with --quantize int4|int8")
    elif float_weights and spec.gguf:
        kernels = str(KERNEL_DTYPE).removeprefix("torch.")
        log.info(
            "quantize: none, because --dtype %s was given and the int4 / int8 kernels compute in %s",
            args.dtype,
            kernels,
        )
    return spec


def compile_model(placement: "Placement", args: argparse.Namespace) -> bool:
    """--compile, by default on where the compiled layers run inside CUDA graphs. Outside graphs each compiled frame
    checks its guards on every call, every layer's frames each step, which costs about what the fusion saves
    (bench/results/README.md)."""
    if args.compile is not None:
        return args.compile
    return placement.device.type == "cuda" and args.cuda_graphs and not args.deterministic
