"""Fixtures of the kernel tests."""

import pytest

from fagen.kernels import compile as compiler


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FAGEN_CACHE_DIR", str(tmp_path / "cache"))
    compiler.clear_memory_cache()
    yield tmp_path / "cache"
    compiler.clear_memory_cache()
