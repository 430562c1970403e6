"""Shared fixtures: the built-in tiny model, created once per test session in a private cache."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("pdserve-cache")
    os.environ["PDSERVE_CACHE_DIR"] = str(path)  # inherited by every process a test starts
    return path


@pytest.fixture(scope="session")
def tiny_model_dir(cache_dir: Path) -> Path:
    from pdserve.engine import builtin

    return builtin.ensure("tiny", cache_dir=cache_dir)
