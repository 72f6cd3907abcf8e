"""The engine's settings: one object, built once from the command line (or by a test) and read by every part."""

import os
from dataclasses import dataclass

import psutil

REASONING_PARSERS = ("auto", "none")


@dataclass(frozen=True)
class EngineConfig:
    deterministic: bool = False  # batch invariance: a request's tokens do not depend on what else runs
    max_batch: int = 16  # requests that run at once (each holds a batch row; KV memory is the block pool's)
    max_queue: int = 64  # admitted requests that may wait for a slot; beyond both the engine refuses (EngineBusy)
    prefill_chunk: int = 512  # prompt tokens per round, over all prefilling requests
    kv_cache_bytes: int | None = None  # the block pool's size; None: sized from the memory left after the weights
    block_size: int = 16  # token positions per KV block
    prefix_caching: bool = True  # a prompt's cached prefix (whole blocks) is reused, not computed again
    # The host memory a runtime's own prompt cache may take (llama.cpp's saved sequence states, as llama-server's
    # --cache-ram); None: as much as the KV pool, at most 8 GiB; 0: none.
    prompt_cache_bytes: int | None = None
    cuda_graphs: bool = True  # decode steps (and first prompt chunks) replayed as CUDA graphs on a GPU
    compile_model: bool = False  # the forward through torch.compile
    threads: int | None = None  # CPU threads of the forward; None: default_threads() (on torch: its own default)
    # "auto": a reasoning model's format detected from its chat template (ServedModel.reasoning); "none": no format.
    reasoning_parser: str = "auto"
    grammar_compile_timeout_s: float = 10.0  # a grammar that takes longer to compile is refused, its compile stopped

    def __post_init__(self) -> None:
        if self.max_batch < 1 or self.max_queue < 0:
            raise ValueError("max_batch must be at least 1 and max_queue at least 0")
        if self.prefill_chunk < 1:
            raise ValueError("prefill_chunk must be at least 1")
        if self.block_size < 1:
            raise ValueError("block_size must be at least 1")
        if self.prompt_cache_bytes is not None and self.prompt_cache_bytes < 0:
            raise ValueError("prompt_cache_bytes must be at least 0")
        if self.threads is not None and self.threads < 1:
            raise ValueError("threads must be at least 1")
        if self.grammar_compile_timeout_s <= 0:
            raise ValueError("grammar_compile_timeout_s must be positive")
        if self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"reasoning_parser must be one of {', '.join(REASONING_PARSERS)}")


def default_threads() -> int:
    """The CPU threads of a forward without --threads: OMP_NUM_THREADS where it is a positive integer (as torch's own
    default reads it, so both runtimes follow one setting), else the physical cores."""
    value = os.environ.get("OMP_NUM_THREADS", "")
    if value.isdigit() and int(value) > 0:
        return int(value)
    return psutil.cpu_count(logical=False) or 1
