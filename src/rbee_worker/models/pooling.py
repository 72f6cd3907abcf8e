"""How a model turns a text's hidden states into one embedding, as sentence-transformers says it beside the weights:
`modules.json` lists a Pooling module (its `config.json`: which positions make the embedding) and maybe a Normalize
module. A model without that config pools as vLLM pools a decoder by default: its last token, normalized."""

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# sentence-transformers' pooling_mode_* flags this worker computes, and its names for them.
MODES = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls"}


@dataclass(frozen=True)
class Pooling:
    mode: str  # "last", "mean" or "cls"; anything else is named in `unsupported`
    normalize: bool  # divided by its L2 norm
    matryoshka: bool = False  # its first dimensions make a smaller embedding (`dimensions`)
    unsupported: str | None = None  # a pooling this worker does not compute (sentence-transformers' name)


LAST_NORMALIZED = Pooling("last", True)


def pooling_of(path: Path) -> Pooling:
    """The pooling of the model at `path` (a directory; a file has no sentence-transformers config)."""
    directory = path if path.is_dir() else path.parent
    modules_file = directory / "modules.json"
    config = _json(directory / "config.json") or {}
    matryoshka = bool(config.get("is_matryoshka") or config.get("matryoshka_dimensions"))
    if not path.is_dir() or not modules_file.is_file():
        return Pooling("last", True, matryoshka)
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


def _json(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.is_file() else None
