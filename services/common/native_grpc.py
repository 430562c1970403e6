"""gRPC on its C++ core for the router's hot path: the library, and the choice of it.

Two parts, one shared library built from csrc/grpc_server.cc and csrc/grpc_calls.cc on first
use (libgrpc++ and its headers, g++ and pkg-config: Debian `apt-get install libgrpc++-dev g++
pkg-config`), cached beside pdserve's other native libraries and loaded with ctypes:

- native_server.py: the router's port (every service on it: Router, RouterPeers, health,
  reflection), answered by the same Python handlers as grpcio's server;
- native_calls.py: the router's calls to its workers (Reserve, Prefill, a sequence's Decode,
  the health rounds' Stats and Check).

Both take every event of their calls on a C++ thread and wake a Python thread only for what
it waits for: a request, a reply, the next message. What grpcio's Python layer did per message
and per call (a handler's thread waiting for each message it sends, the call objects, its
event-engine threads) is gone; the handlers, servicers and errors are the same. At 1,000
simulated workers and 150 req/s the router's CPU per request fell by 11-19%
(docs/benchmarks.md, issue 24).

`--grpc-library auto` (the default) uses it where it builds and says once why not elsewhere;
`native` refuses to start without it; `grpcio` never uses it.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
from pathlib import Path

from pdserve.common.native import build_shared, kernels_dir

log = logging.getLogger("pdserve.server")

SOURCES = tuple(Path(__file__).with_name("csrc") / name
                for name in ("grpc_server.cc", "grpc_calls.cc", "token_relay.cc"))
HEADER = SOURCES[0].with_name("grpc_options.h")
NEEDS = "Debian: apt-get install libgrpc++-dev g++ pkg-config"
CHOICES = ("auto", "native", "grpcio")
PACKAGES = ("grpc++", "absl_synchronization")
_p = ctypes.c_void_p
_str_p = ctypes.POINTER(ctypes.c_char_p)
_size_p = ctypes.POINTER(ctypes.c_size_t)


def target_path() -> Path:
    """Where the library of these sources is cached (built or not)."""
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in (*SOURCES, HEADER))).hexdigest()
    return kernels_dir() / f"native_grpc-{digest[:16]}.so"


def library_path() -> Path:
    """The built library (built now when it is not cached); RuntimeError naming what is
    missing when it cannot be built here."""
    target = target_path()
    if target.is_file():
        return target
    cxx = os.environ.get("CXX") or shutil.which("g++")
    if not (cxx and shutil.which("pkg-config")):
        raise RuntimeError(f"g++ and pkg-config are needed to build it ({NEEDS})")
    try:
        flags = _run(["pkg-config", "--cflags", *PACKAGES]).split()
        libs = _run(["pkg-config", "--libs", *PACKAGES]).split()
        build_shared(cxx, [(source, ["-O2", "-std=c++17", "-fPIC", *flags])
                           for source in SOURCES], target, ["-shared"], libs)
    except subprocess.CalledProcessError as exc:
        raise RuntimeError(f"{Path(exc.cmd[0]).name} failed: "
                           f"{(exc.stderr or exc.stdout).strip()[-1500:]} ({NEEDS})") from None
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise RuntimeError(f"{exc} ({NEEDS})") from None
    return target


def _run(argv: list[str]) -> str:
    return subprocess.run(argv, check=True, capture_output=True, text=True, timeout=60).stdout


# Calls that wait release the GIL, as ctypes does; the rest keep it (`PyDLL`): they take
# microseconds, and a thread that lets the GIL go hands it to any other that wants it.
_QUICK = ("pds_describe", "pds_identities", "pds_write", "pds_finish", "pds_active",
          "pds_cancel", "pds_release", "pdn_start", "pdn_status", "pdn_cancel", "pdn_free",
          "pdn_channel_free", "pdr_vocab", "pdr_vocab_free", "pdr_new", "pdr_free", "pdr_accept",
          "pdr_feed", "pdr_tokens", "pdr_finish_reason", "pdr_sent", "pdr_status")


@functools.cache
def library() -> ctypes.CDLL:
    """The loaded library (built on first use); RuntimeError when it cannot be."""
    path = str(library_path())
    try:
        lib = ctypes.CDLL(path)
        quick = ctypes.PyDLL(path)
    except OSError as exc:  # built here before, its libgrpc++ gone since (or another machine's)
        raise RuntimeError(f"{path} does not load: {exc} ({NEEDS})") from None
    for name in _QUICK:
        setattr(lib, name, getattr(quick, name))
    # the server (csrc/grpc_server.cc)
    lib.pds_start.restype = _p
    lib.pds_start.argtypes = [ctypes.c_char_p] * 5 + [ctypes.c_int, ctypes.POINTER(ctypes.c_int)]
    for name in ("pds_accept", "pds_next_ended"):
        getattr(lib, name).restype = _p
        getattr(lib, name).argtypes = [_p]
    lib.pds_stop.argtypes = [_p, ctypes.c_double]
    lib.pds_describe.argtypes = [_p, _str_p, _str_p, _size_p, _str_p,
                                 ctypes.POINTER(ctypes.c_double)]
    lib.pds_identities.restype = ctypes.c_char_p
    lib.pds_identities.argtypes = [_p]
    lib.pds_read.argtypes = [_p, _str_p, _size_p]
    lib.pds_write.argtypes = [_p, ctypes.c_char_p, ctypes.c_size_t]
    lib.pds_wait_below.argtypes = [_p, ctypes.c_int]
    lib.pds_finish.argtypes = [_p, ctypes.c_int, ctypes.c_char_p]
    for name in ("pds_active", "pds_cancel", "pds_release"):
        getattr(lib, name).argtypes = [_p]
    # the calls (csrc/grpc_calls.cc)
    lib.pdn_channel.restype = _p
    lib.pdn_channel.argtypes = [ctypes.c_char_p] * 5 + [ctypes.c_int]
    lib.pdn_channel_free.argtypes = [_p]
    lib.pdn_start.restype = _p
    lib.pdn_start.argtypes = [_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t,
                              ctypes.c_double, ctypes.c_char_p, ctypes.c_int]
    lib.pdn_next.argtypes = [_p, _str_p, _size_p]
    lib.pdn_status.argtypes = [_p, _str_p]
    for name in ("pdn_cancel", "pdn_free"):
        getattr(lib, name).argtypes = [_p]
    return lib


def choose(mode: str) -> ctypes.CDLL | None:
    """The library for `--grpc-library MODE` (None: grpcio). `native` without it:
    RuntimeError saying why; `auto` without it logs why once and goes on with grpcio."""
    if mode == "grpcio":
        return None
    try:
        return library()
    except RuntimeError as exc:
        if mode == "native":
            raise RuntimeError(f"--grpc-library native: gRPC's C++ library cannot be built "
                               f"here: {exc}") from None
        log.warning("serving on grpcio: gRPC's C++ library cannot be built here (%s)", exc)
        return None
