"""Shared fixtures: the real demo model (downloaded once into the cache) and paths derived from it."""

from pathlib import Path

import pytest

from rbee_worker.models.demo import demo_model_path


@pytest.fixture(scope="session")
def demo_gguf() -> Path:
    return demo_model_path()
