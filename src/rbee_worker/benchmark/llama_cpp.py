"""llama-cpp-python (an optional extra), opened the same way for the benchmark's peer and the accuracy checks.

On CPUs with AMX (Intel Xeon since Sapphire Rapids), llama.cpp repacks the quantized matrices into its AMX buffers at
load. There, with llama-cpp-python 0.3.36, every batch of more than one token crashes the process (SIGSEGV in
llama_decode; llama.cpp issue 20824 reports the same crash in `ggml_backend_amx_mul_mat`), while one-token batches run,
twice as fast as from ggml's plain CPU buffers (the demo model on 2 cores of such a machine: about 190 against 94
tok/s). `plain_buffers=True` is llama.cpp's `--no-repack`: every matrix stays in ggml's plain CPU buffers, where
batches of any size run. Elsewhere both load the same buffers.
"""

from typing import TYPE_CHECKING, Any

from rbee_worker.models.llama_cpp_model import has_amx

if TYPE_CHECKING:
    from llama_cpp import Llama

__all__ = ["has_amx", "open_llama"]


def open_llama(path: str, *, plain_buffers: bool, **kwargs: Any) -> "Llama":
    """`Llama(model_path=path, **kwargs)`, with the matrices in ggml's plain CPU buffers if `plain_buffers`."""
    import llama_cpp.llama_cpp as native
    from llama_cpp import Llama

    if not plain_buffers:
        return Llama(model_path=path, **kwargs)
    # Llama() takes its model parameters from this function and exposes no argument for `use_extra_bufts`.
    defaults = native.llama_model_default_params

    def plain() -> native.llama_model_params:
        params = defaults()
        params.use_extra_bufts = False
        return params

    native.llama_model_default_params = plain
    try:
        return Llama(model_path=path, **kwargs)
    finally:
        native.llama_model_default_params = defaults
