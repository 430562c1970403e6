"""Choosing gRPC's C++ library (common/native_grpc.py): what `auto` and `native` do when it
cannot be had."""

from __future__ import annotations

import logging

import pytest
from pdserve.common import native_grpc


def test_a_cached_library_that_does_not_load_falls_back_or_is_refused(tmp_path, monkeypatch,
                                                                         caplog):
    """Built here before and its libgrpc++ removed since, or copied from another machine: the
    router must not crash at start (auto: grpcio, saying why; native: a clear refusal)."""
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    target = native_grpc.target_path()
    target.parent.mkdir(parents=True)
    target.write_bytes(b"not a shared library")
    native_grpc.library.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="pdserve.server"):
            assert native_grpc.choose("auto") is None
        assert "serving on grpcio" in caplog.text and "does not load" in caplog.text
        with pytest.raises(RuntimeError, match=r"--grpc-library native: .*does not load"):
            native_grpc.choose("native")
        assert native_grpc.choose("grpcio") is None
    finally:
        native_grpc.library.cache_clear()  # the next test loads the session's own build
