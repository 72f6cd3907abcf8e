"""What a model load needs, found and checked once before anything loads (loading/loader.py probe_model): the loader,
the tensor-parallel ranks (each with its own placement and shard) and the worker's settings carry it as it is."""

from dataclasses import dataclass
from pathlib import Path

from rbee_worker.hardware.devices import Placement


@dataclass(frozen=True)
class Shard:
    """A tensor-parallel rank's part of the model: rank `rank` of `world`."""

    rank: int
    world: int


@dataclass(frozen=True)
class ModelSpec:
    """MODEL as probed: where it is, its format, and the runtime, quantization and placement it loads with."""

    name: str  # MODEL as given: a directory, a .gguf file, a hub id or `demo`
    path: Path  # the file or directory it names (the demo's cached file, which the load fetches on first use)
    gguf: bool  # a GGUF file; otherwise a model directory
    placement: Placement
    runtime: str  # torch | llama.cpp
    # none | int8 | int4 on the torch runtime (for a GGUF file int8 and int4 alike keep its quantized types); none on
    # the llama.cpp runtime, which keeps the file's types whatever it says
    quantize: str
    max_context: int | None = None  # None: the model's own context
    chat_template: str | None = None  # Jinja text; None: the model's own
    # A tensor-parallel rank's shard, which the loader builds alone (loading/sharding/tp_loading.py); None: the whole
    # model
    shard: Shard | None = None
