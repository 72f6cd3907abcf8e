"""How a model turns a text's hidden states into one embedding, as sentence-transformers says it beside the weights:
`modules.json` lists a Pooling module (its `config.json`: which positions make the embedding) and maybe a Normalize
module. A decoder without that config pools as vLLM pools a decoder by default (its last token, normalized), an encoder
as sentence-transformers pools a plain transformers model (the mean of its positions)."""

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# llama.cpp's pooling types (a GGUF file's `<arch>.pooling_type`) this worker computes, and its names for them.
GGUF_MODES = {1: "mean", 2: "cls", 3: "last"}
# sentence-transformers' pooling_mode_* flags this worker computes, and its names for them.
MODES = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls"}


@dataclass(frozen=True)
class Pooling:
    mode: str  # "last", "mean" or "cls"; anything else is named in `unsupported`
    normalize: bool  # divided by its L2 norm
    matryoshka: bool = False  # its first dimensions make a smaller embedding (`dimensions`)
    unsupported: str | None = None  # a pooling this worker does not compute (sentence-transformers' name)


LAST_NORMALIZED = Pooling("last", True)


def pooling_of(path: Path, encoder: bool = False) -> Pooling:
    """The pooling of the model at `path`: a directory's sentence-transformers config, a GGUF file's pooling type
    (normalized, as llama-server normalizes); `encoder`: the model is an encoder (loading/loaded.py's ModelInfo)."""
    if path.is_file():
        return gguf_pooling(path)
    directory = path
    modules_file = directory / "modules.json"
    config = _json(directory / "config.json") or {}
    matryoshka = bool(config.get("is_matryoshka") or config.get("matryoshka_dimensions"))
    if not modules_file.is_file():
        return Pooling("mean", False, matryoshka) if encoder else Pooling("last", True, matryoshka)
    modules = json.loads(modules_file.read_text())
    normalize = any(m.get("type", "").endswith("Normalize") for m in modules)
    pooling = next((m for m in modules if m.get("type", "").endswith("Pooling")), None)
    if pooling is None:
        return Pooling("last", normalize, matryoshka)
    settings = _json(directory / pooling.get("path", "") / "config.json") or {}
    chosen = [flag for flag, on in settings.items() if flag.startswith("pooling_mode_") and on]
    if len(chosen) == 1 and chosen[0] in MODES:
        return Pooling(MODES[chosen[0]], normalize, matryoshka)
    return Pooling("mean", normalize, matryoshka, unsupported=" + ".join(chosen) or "none")


def finished(vector: np.ndarray, normalize: bool, dimensions: int | None = None) -> np.ndarray:
    """A pooled embedding as the client gets it: cut to its first `dimensions` (a Matryoshka model's smaller
    embedding), then divided by its L2 norm where the model normalizes (sentence-transformers' eps)."""
    if dimensions is not None:
        vector = vector[:dimensions]
    if normalize:
        vector = vector / max(float(np.linalg.norm(vector)), 1e-12)
    return vector.astype(np.float32)


def gguf_pooling(path: Path) -> Pooling:
    from rbee_worker.loading.gguf.gguf_format import read_gguf

    metadata = read_gguf(path).metadata
    kind = metadata.get(f"{metadata.get('general.architecture')}.pooling_type", 0)
    if kind in (0, 3):  # none (a generative model) or last
        return LAST_NORMALIZED
    if kind in GGUF_MODES:
        return Pooling(GGUF_MODES[kind], True)
    return Pooling("mean", True, unsupported=f"llama.cpp's pooling type {kind}")


def _json(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.is_file() else None
