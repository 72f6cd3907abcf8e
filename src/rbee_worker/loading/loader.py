"""MODEL (a directory, a .gguf file, `demo`, or a hub id) probed once into a ModelSpec (loading/spec.py), then loaded
onto its device."""

import dataclasses
import logging
import re
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from rbee_worker.errors import ModelLoadError
from rbee_worker.hardware.devices import Placement, check_placement
from rbee_worker.layers.quantize import quantized_supported
from rbee_worker.loading.demo import demo_model_path, demo_path
from rbee_worker.loading.gguf.llama_cpp_model import llama_cpp_installed, load_llama_cpp
from rbee_worker.loading.loaded import LoadedModel
from rbee_worker.loading.progress import LoadProgress
from rbee_worker.loading.spec import ModelSpec, Shard

if TYPE_CHECKING:
    from transformers import PretrainedConfig

GGUF_MAGIC = b"GGUF"
RUNTIMES = ("auto", "torch", "llama.cpp")
LLAMA_CPP_DEVICES = ("cpu", "mps")
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
# One load at a time per process: transformers' from_pretrained swaps process-wide state while it runs
# (`PreTrainedModel.tie_weights` by a no-op, torch's default dtype) and puts back what it found, so two loads in
# parallel threads (two Engines) can leave tying disabled for good: the next model with tied embeddings then loads
# without its LM head (transformers 5.24; bench/results/README.md).
_LOADING = threading.Lock()


def resolve_model_path(spec: str) -> Path:
    """The local file or directory that MODEL names; hub ids come from the local huggingface_hub cache only."""
    if spec == "demo":
        return demo_model_path()
    path = Path(spec).expanduser()
    if path.exists():
        return path
    if HUB_ID.fullmatch(spec) and not spec.startswith(("./", "../")):
        return hub_snapshot(spec)
    raise ModelLoadError(f"model path {spec} does not exist; pass a model directory, a .gguf file or `demo`")


def hub_snapshot(repo_id: str) -> Path:
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo_id, local_files_only=True))
    except (LocalEntryNotFoundError, OSError, ValueError) as exc:
        # The spec may also be a mistyped relative path, so say that no such path exists either.
        raise ModelLoadError(
            f"model {repo_id} is neither a local path nor in the local Hugging Face cache ({constants.HF_HUB_CACHE}); "
            f"rbee-worker never downloads weights: fetch it first (e.g. `hf download {repo_id}`) or pass a local path"
        ) from exc


def is_gguf(path: Path) -> bool:
    if path.suffix.lower() == ".gguf":
        return True
    try:
        with path.open("rb") as f:
            return f.read(4) == GGUF_MAGIC
    except OSError as exc:
        raise ModelLoadError(f"cannot read model file {path}: {exc.strerror or exc}; check its permissions") from exc


def auto_runtime(gguf: bool, device: torch.device) -> str:
    """What `--runtime auto` picks: llama.cpp for a GGUF file on cpu or mps where llama-cpp-python is installed, torch
    otherwise."""
    return "llama.cpp" if gguf and device.type in LLAMA_CPP_DEVICES and llama_cpp_installed() else "torch"


def resolve_runtime(runtime: str, path: Path, gguf: bool, device: torch.device) -> str:
    """The runtime that runs the model, torch or llama.cpp: `auto` as auto_runtime says; an explicit llama.cpp must
    have a GGUF file, a device it serves and the package."""
    if runtime not in RUNTIMES:
        raise ModelLoadError(f"unknown --runtime {runtime!r}; use {', '.join(RUNTIMES)}")
    if runtime == "auto":
        return auto_runtime(gguf, device)
    if runtime == "llama.cpp" and device.type not in LLAMA_CPP_DEVICES:
        raise ModelLoadError(
            f"--runtime llama.cpp runs GGUF files on cpu or mps, not on {device}: use --runtime torch (or auto) there"
        )
    if runtime == "llama.cpp" and not gguf:
        raise ModelLoadError(
            f"--runtime llama.cpp runs GGUF files, and {path.name} is not one: use --runtime torch (or auto) for it"
        )
    if runtime == "llama.cpp" and not llama_cpp_installed():
        raise ModelLoadError(
            "--runtime llama.cpp needs llama-cpp-python: `pip install llama-cpp-python` (it builds llama.cpp from "
            "source, with a C/C++ compiler and cmake), or use --runtime torch"
        )
    return runtime


def resolve_quantize(quantize: str, gguf: bool, placement: Placement) -> str:
    """The quantization the torch runtime loads with: `auto` keeps a GGUF file's types where the int4 / int8 kernels
    run on this placement (as int4: for a GGUF file int4 and int8 alike mean "keep the file's types") and loads
    everything else as `none`; an explicit int8 / int4 must have those kernels."""
    if quantize == "auto":
        return "int4" if gguf and quantized_supported(placement.device, placement.dtype) else "none"
    if quantize != "none" and not quantized_supported(placement.device, placement.dtype):
        raise ModelLoadError(
            f"--quantize {quantize} runs on the CPU, or in bfloat16 on a CUDA GPU of compute capability 8.0 or newer "
            f"with Triton; {placement.device} with {str(placement.dtype).removeprefix('torch.')} cannot: drop "
            "--quantize, or on such a GPU add --dtype bfloat16"
        )
    return quantize


def probe_model(
    name: str,
    placement: Placement,
    *,
    runtime: str = "torch",
    quantize: str = "none",
    max_context: int | None = None,
    chat_template: str | None = None,
    shard: Shard | None = None,
) -> ModelSpec:
    """MODEL found and checked once, before anything loads, without reading its weights: its file or directory (a
    hub id from the local cache; the demo where it is cached, not fetched yet), whether it is a GGUF file, the runtime
    that runs it (resolve_runtime, never `auto`) and the quantization it loads with (resolve_quantize); every failure
    is a ModelLoadError with a one-line message.

    `max_context` caps the context below the model's own (less KV memory); `chat_template` (Jinja text) replaces the
    model's own; `shard` loads a tensor-parallel rank's part alone; `quantize` "int8" / "int4" quantizes a float model's
    decoder layers at load (layers/quantize.py) and keeps a GGUF file's quantized matrices in its own types (either
    value: the file decides; loading/gguf/gguf_model.py). On llama.cpp a GGUF file keeps its own types, whatever
    `quantize` and the placement's dtype say.
    """
    if name == "demo":
        path, gguf = demo_path(), True
    else:
        path = resolve_model_path(name)
        gguf = path.is_file() and is_gguf(path)
        if not gguf and not path.is_dir():
            raise ModelLoadError(f"{path} is neither a model directory nor a .gguf file")
    runtime = resolve_runtime(runtime, path, gguf, placement.device)
    quantize = "none" if runtime == "llama.cpp" else resolve_quantize(quantize, gguf, placement)
    return ModelSpec(name, path, gguf, placement, runtime, quantize, max_context, chat_template, shard)


def model_files(spec: ModelSpec) -> Path:
    """The probed model's file or directory, there to read: the demo is fetched on its first use."""
    return demo_model_path() if spec.name == "demo" else spec.path


def load_model(
    name: str,
    placement: Placement,
    *,
    runtime: str = "torch",
    quantize: str = "none",
    max_context: int | None = None,
    chat_template: str | None = None,
    shard: Shard | None = None,
) -> LoadedModel:
    """MODEL probed (probe_model, whose arguments these are) and loaded onto the placement's device at once: for a
    caller that has no ModelSpec yet."""
    spec = probe_model(
        name,
        placement,
        runtime=runtime,
        quantize=quantize,
        max_context=max_context,
        chat_template=chat_template,
        shard=shard,
    )
    return load_spec(spec)


def load_spec(spec: ModelSpec, progress: LoadProgress | None = None) -> LoadedModel:
    """Load the probed model onto its placement's device; every failure is a ModelLoadError with a one-line message.
    `progress` follows the load as it goes, and cancels it."""
    import transformers

    from rbee_worker.loading.gguf.gguf_model import load_gguf
    from rbee_worker.loading.hf import load_hf_directory

    # A worker's stderr carries log lines, not progress bars; transformers' advice is noise unless debugging.
    transformers.utils.logging.disable_progress_bar()
    if not logging.getLogger("rbee_worker").isEnabledFor(logging.DEBUG):
        transformers.utils.logging.set_verbosity_error()
    started = time.perf_counter()
    progress = progress or LoadProgress()
    path, placement = model_files(spec), spec.placement
    if spec.runtime == "llama.cpp":
        with _LOADING:
            loaded = load_llama_cpp(path, placement.device, progress)
        return _finish(loaded, spec, progress, started)
    try:
        with _LOADING:
            if spec.gguf:
                quantized = spec.quantize != "none"
                loaded = load_gguf(
                    path, placement.device, placement.dtype, progress, quantized=quantized, shard=spec.shard
                )
            else:
                loaded = load_hf_directory(
                    path, placement.device, placement.dtype, progress, spec.quantize, shard=spec.shard
                )
    except torch.OutOfMemoryError as exc:
        raise ModelLoadError(
            f"not enough memory on {placement.device} to load {path.name}; use a smaller model"
        ) from exc
    except MemoryError as exc:
        raise ModelLoadError(f"not enough host memory to load {path.name}; use a smaller model") from exc
    check_placement(loaded.model, placement.device)
    return _finish(loaded, spec, progress, started)


def _finish(loaded: LoadedModel, spec: ModelSpec, progress: LoadProgress, started: float) -> LoadedModel:
    """Either runtime's last step: --max-context and --chat-template applied, the load time recorded; a load cancelled
    meanwhile stops here rather than go on to the engine's runner."""
    progress.check()
    context, max_context = loaded.info.context_length, spec.max_context
    if max_context is not None and max_context > context:
        raise ModelLoadError(
            f"--max-context {max_context} exceeds the context of {spec.path.name} ({context} tokens); pass at most "
            f"{context}"
        )
    if spec.chat_template is not None:
        loaded.tokenizer.chat_template = spec.chat_template
    info = dataclasses.replace(
        loaded.info, context_length=max_context or context, load_seconds=time.perf_counter() - started
    )
    return dataclasses.replace(loaded, info=info)


def read_model_config(spec: ModelSpec) -> "tuple[PretrainedConfig, str]":
    """The probed model's config and name, read without its weights (a GGUF file's header, or config.json), so that a
    model that cannot be split is refused before any rank starts."""
    from rbee_worker.loading.gguf.gguf_format import read_gguf
    from rbee_worker.loading.gguf.gguf_model import ARCHITECTURES, gguf_config
    from rbee_worker.loading.hf import read_config

    path = model_files(spec)
    if spec.gguf:
        file = read_gguf(path)
        arch = file.metadata.get("general.architecture")
        if arch not in ARCHITECTURES:
            raise ModelLoadError(
                f"--tensor-parallel splits GGUF files of the {', '.join(ARCHITECTURES)} architectures; {path.name} is "
                f"{arch}: use its Hugging Face directory"
            )
        return gguf_config(file, arch), path.stem
    return read_config(path), path.name
