"""A GGUF file loaded by llama.cpp's runtime (llama-cpp-python's low-level bindings) instead of into a transformers
model: llama.cpp owns the weights and the forward, the worker keeps everything around it.

Only the weights go to llama.cpp. The tokenizer, chat template, end-of-sequence ids and context length come from the
worker's own GGUF reader (loading/gguf/gguf_format.py, loading/gguf/gguf_tokenizer.py), exactly as for the torch
runtime, so llama.cpp only ever sees token ids.

On CPUs with AMX (Intel Xeon since Sapphire Rapids), llama.cpp repacks the quantized matrices into its AMX buffers at
load. There, with llama-cpp-python 0.3.36, every batch of more than one token crashes the process (SIGSEGV in
llama_decode; llama.cpp issue 20824 reports the same crash in `ggml_backend_amx_mul_mat`), while one-token batches run.
`use_extra_bufts = False` (llama.cpp's `--no-repack`) keeps every matrix in ggml's plain CPU buffers, where batches of
any size run; the worker loads so on such CPUs.
"""

import ctypes
import importlib.util
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rbee_worker.errors import ModelLoadError
from rbee_worker.loading.gguf.gguf_format import GGUFFile, read_gguf
from rbee_worker.loading.gguf.gguf_model import end_token_ids
from rbee_worker.loading.gguf.gguf_tokenizer import build_tokenizer
from rbee_worker.loading.loaded import LoadedModel, ModelInfo, eos_ids
from rbee_worker.loading.progress import LoadCancelled, LoadProgress

log = logging.getLogger(__name__)

KV_BYTES_PER_VALUE = 2  # llama.cpp's default KV cache type, F16 (llama_context_params.type_k / type_v)
_GGML_LOG_ERROR = 4  # ggml_log_level: GGML_LOG_LEVEL_ERROR


def llama_cpp_installed() -> bool:
    """Whether llama-cpp-python is importable here (an optional dependency: it builds llama.cpp from source)."""
    return importlib.util.find_spec("llama_cpp") is not None


def has_amx() -> bool:
    """Whether llama.cpp uses AMX on this machine (then batches of several tokens need ggml's plain buffers)."""
    import llama_cpp

    return b"AMX_INT8 = 1" in llama_cpp.llama_print_system_info()


@dataclass
class LlamaCppModel:
    """A llama.cpp model handle and llama.cpp's own figures about it."""

    handle: Any  # llama_model_p
    vocab_size: int  # the logits' width (llama_vocab_n_tokens)
    layers: int
    kv_bytes_per_token: int  # keys and values of one token over all layers, in llama.cpp's F16 cache

    def close(self) -> None:
        """Free the model (no context may use it any more)."""
        import llama_cpp.llama_cpp as native

        if self.handle is not None:
            native.llama_model_free(self.handle)
            self.handle = None


# llama.cpp's encoder architectures (attention both ways over a whole input; embeddings only).
GGUF_ENCODERS = frozenset(
    {"bert", "nomic-bert", "nomic-bert-moe", "jina-bert-v2", "jina-bert-v3", "modern-bert", "neo-bert"}
)


def load_llama_cpp(path: Path, device: torch.device, progress: LoadProgress) -> LoadedModel:
    """The GGUF file's model on llama.cpp (all layers on the GPU for `mps`, none elsewhere), with the worker's own
    tokenizer and facts about the file. Weights' bytes are llama.cpp's (llama_model_size)."""
    import llama_cpp.llama_cpp as native

    file = read_gguf(path)
    meta = file.metadata
    arch = meta.get("general.architecture")
    if arch in GGUF_ENCODERS:
        raise ModelLoadError(
            f"{path.name} (GGUF architecture {arch!r}) is an encoder, which the llama.cpp runtime does not serve: "
            "serve the model's Hugging Face directory (embeddings on the torch runtime)"
        )
    try:
        tokenizer = build_tokenizer(meta)
    except ModelLoadError as exc:
        raise ModelLoadError(f"{path.name} (GGUF architecture {arch!r}): {exc}") from exc
    layers = meta.get(f"{arch}.block_count")
    progress.expect(layers if type(layers) is int and layers > 0 else 1, path.stat().st_size)
    progress.check()  # reading the file's metadata and tokenizer takes a while: a cancel meanwhile stops here
    _route_logs()
    params = native.llama_model_default_params()
    params.n_gpu_layers = -1 if device.type == "mps" else 0
    if device.type == "cpu" and has_amx():
        params.use_extra_bufts = False  # see the module docstring

    def report(share: float, _: ctypes.c_void_p) -> bool:
        progress.bytes_loaded = int(share * progress.bytes_total)
        return not progress.cancelled  # false stops the load

    callback = native.llama_progress_callback(report)
    params.progress_callback = callback
    _errors.clear()
    handle = native.llama_model_load_from_file(str(path).encode(), params)
    if not handle:
        if progress.cancelled:
            raise LoadCancelled("the model load was cancelled")
        why = _errors[0] if _errors else "see its messages with --log-level debug"  # the first says why
        raise ModelLoadError(
            f"llama.cpp cannot load {path.name} (GGUF architecture {arch!r}: {why}); download or convert the model "
            "again, or try --runtime torch"
        )
    vocab_size = native.llama_vocab_n_tokens(native.llama_model_get_vocab(handle))
    model = LlamaCppModel(handle, vocab_size, native.llama_model_n_layer(handle), kv_bytes_per_token(handle, meta))
    context = meta.get(f"{arch}.context_length") or native.llama_model_n_ctx_train(handle)
    info = ModelInfo(
        name=path.stem,
        path=path,
        format="gguf",
        architecture=str(arch),
        context_length=int(context),
        eos_token_ids=eos_ids(tokenizer.eos_token_id, end_token_ids(file)),
        device=device,
        dtype=torch.float32,  # the logits' type; the weights keep the file's types
        weight_bytes=native.llama_model_size(handle),
        runtime="llama.cpp",
        unrouted_bytes=unrouted_tensor_bytes(file, str(arch)),
    )
    progress.bytes_loaded = progress.bytes_total
    return LoadedModel(model, tokenizer, info)  # type: ignore[arg-type]  # LoadedModel.model: either runtime's


def unrouted_tensor_bytes(file: GGUFFile, arch: str) -> int:
    """The bytes of a GGUF mixture of experts' expert tensors (llama.cpp's `*_exps.*`, each stacking every expert of
    a layer; not the shared experts' `*_shexp.*`) that one token does not read: (experts - routed) / experts of them."""
    experts, routed = file.metadata.get(f"{arch}.expert_count"), file.metadata.get(f"{arch}.expert_used_count")
    if not isinstance(experts, int) or not isinstance(routed, int) or not 0 < routed < experts:
        return 0
    stacked = sum(info.nbytes for name, info in file.tensors.items() if "_exps." in name)
    return stacked * (experts - routed) // experts


def kv_bytes_per_token(handle: Any, meta: dict[str, Any]) -> int:
    """Bytes of keys and values that one token of context takes in llama.cpp's cache: every layer's KV heads times
    the key and value lengths (the GGUF file's, else n_embd / n_head, as llama.cpp reads them), in F16."""
    import llama_cpp.llama_cpp as native

    arch = meta.get("general.architecture")
    head_dim = native.llama_model_n_embd(handle) // max(native.llama_model_n_head(handle), 1)
    key = meta.get(f"{arch}.attention.key_length") or head_dim
    value = meta.get(f"{arch}.attention.value_length") or head_dim
    heads = native.llama_model_n_head_kv(handle)
    return native.llama_model_n_layer(handle) * heads * (key + value) * KV_BYTES_PER_VALUE


_log_callback: Any = None  # llama.cpp keeps the pointer: the ctypes callback must live as long as the process
_errors: list[str] = []  # llama.cpp's error messages since the current load began


def _route_logs() -> None:
    """llama.cpp's messages into the worker's log at debug level instead of raw lines on stderr, which carries the
    worker's one-line-per-event log; its errors are also kept for the message of a load that fails."""
    global _log_callback
    if _log_callback is not None:
        return
    import llama_cpp.llama_cpp as native

    def forward(level: int, text: bytes, _: ctypes.c_void_p) -> None:
        if not (message := text.decode(errors="replace").strip()):
            return
        if level == _GGML_LOG_ERROR and len(_errors) < 8:
            _errors.append(message)
        log.debug("llama.cpp: %s", message)

    _log_callback = native.llama_log_callback(forward)
    native.llama_log_set(_log_callback, ctypes.c_void_p())
    native.llama_backend_init()
