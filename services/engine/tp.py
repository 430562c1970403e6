"""A tensor-parallel worker's ranks: one process each, pinned to its own cores, rank 0 driving.

Rank 0 is the worker process itself: it serves the gRPC API, schedules, samples, and before
every forward hands the step's batch to the other ranks over a socket pair each (a few hundred
bytes; the ranks rebuild the tensors). Every rank runs its shard of the model (tp_shard.py)
over its own KV pool, which holds its KV heads (its fingerprint carries its rank), and the
ranks sum their row-parallel partials with `torch.distributed` all-reduces (gloo on CPU, over
loopback: all ranks of a worker share a host). The page ids are rank 0's: every rank's pool
has the same number of pages and a step writes the same slots in each.

A rank that exits fails the whole worker: rank 0's watcher sees it at once and calls
`on_death` (the worker stops serving and exits non-zero), and a collective it was part of
raises on the others instead of waiting (gloo sees the closed connection). Ranks 1.. exit when
rank 0 goes away: their socket closes, and the kernel signals them if rank 0 dies (Linux).
"""

from __future__ import annotations

import ctypes
import datetime
import json
import logging
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from pdserve.common.shm import SharedSegment
from pdserve.engine import kernels
from pdserve.engine.batch import Batch
from pdserve.engine.pool import KVPool
from torch.distributed import TCPStore  # type: ignore[attr-defined]

log = logging.getLogger("pdserve.engine.tp")
PR_SET_PDEATHSIG = 1
COLLECTIVE_TIMEOUT_S = 120.0  # a collective that long is a hung rank, not a slow one
# A shared all-reduce of fewer bytes keeps the GIL for its first HELD_WAIT_S (cheaper than a
# hand-over to the serving threads and back, for a sum of microseconds), then waits without it.
SMALL_REDUCE_BYTES = 1 << 20
HELD_WAIT_S = 0.002
_LEN = struct.Struct("<Q")
_TENSORS = ("input_ids", "positions", "query_starts", "context_lens", "block_tables",
            "slot_pages", "slot_offsets", "last_index")


class RankFailed(RuntimeError):
    """A tensor-parallel rank could not start, or exited."""


@dataclass(frozen=True)
class RankSpec:
    """What a rank process needs to build its shard and pool (rank 0's choices)."""

    model_dir: str
    model_id: str | None
    dtype: str
    device: str
    block_size: int
    num_pages: int
    size: int
    store_port: int
    threads: int
    slot_bytes: int = 0  # the shared-memory all-reduce's slot (0: gloo only)


def split_cores(cpus: list[int], size: int) -> list[list[int]]:
    """`cpus` cut into `size` runs as even as they go (rank r gets run r); with fewer cores
    than ranks, ranks share them round-robin."""
    cpus = sorted(cpus)
    if len(cpus) < size:
        return [[cpus[r % len(cpus)]] for r in range(size)]
    base, extra = divmod(len(cpus), size)
    out, start = [], 0
    for r in range(size):
        n = base + (r < extra)
        out.append(cpus[start:start + n])
        start += n
    return out


class Timer:
    """All-reduce count and seconds since the last `take` (for stats and the benchmark)."""

    def __init__(self) -> None:
        self.calls = 0
        self.seconds = 0.0

    def take(self) -> tuple[int, float]:
        calls, seconds = self.calls, self.seconds
        self.calls, self.seconds = 0, 0.0
        return calls, seconds


class SharedReduce:
    """The ranks' all-reduce through a shared segment (csrc/allreduce.c): float32 tensors up
    to `slot_bytes`; gloo takes the rest. Every rank calls it in the same order, so the
    sequence numbers agree."""

    def __init__(self, segment: SharedSegment, rank: int, size: int, slot_bytes: int):
        lib = kernels.library()
        if lib is None:
            raise RankFailed("the shared-memory all-reduce needs the native kernels (no C "
                             "compiler, no prebuilt kernels)")
        self.segment, self.rank, self.size, self.slot_bytes = segment, rank, size, slot_bytes
        self._base = np.frombuffer(segment.buffer, dtype=np.uint8).ctypes.data
        self._released = _declare(lib)  # the GIL released: large sums
        self._held = _declare(ctypes.PyDLL(lib._name))  # kept: small ones (a decode step's)
        self._seq = 0

    @staticmethod
    def segment_bytes(size: int, slot_bytes: int) -> int:
        return 64 * (size + 1) + 2 * size * slot_bytes

    def takes(self, t: torch.Tensor) -> bool:
        """Whether `t` goes through the segment: contiguous float32 that fits a slot."""
        return t.dtype == torch.float32 and t.is_contiguous() and t.nbytes <= self.slot_bytes

    def all_reduce(self, t: torch.Tensor) -> None:
        if not self.takes(t):
            raise ValueError(f"the shared all-reduce takes contiguous float32 tensors of up to "
                             f"{self.slot_bytes} bytes, not {t.dtype} of {t.nbytes}")
        self._seq += 1
        args = (self._base, self.rank, self.size, t.data_ptr(), t.numel(), self.slot_bytes,
                self._seq)
        rc = -1
        if t.nbytes < SMALL_REDUCE_BYTES:  # first a short wait with the GIL held
            rc = self._held(*args, 0, HELD_WAIT_S)
        if rc == -1:  # (then without it: the thread that sets the abort flag can run)
            rc = self._released(*args, int(t.nbytes < SMALL_REDUCE_BYTES),
                                COLLECTIVE_TIMEOUT_S)
        if rc:
            raise RankFailed("tensor-parallel all-reduce: " + (
                "a rank exited" if rc == -2 else
                f"a rank did not arrive within {COLLECTIVE_TIMEOUT_S:.0f} s"))

    def abort(self) -> None:
        """Wake every rank waiting in an all-reduce, for good (a rank died, or the group
        stops)."""
        np.frombuffer(self.segment.buffer, dtype=np.uint64)[self.size * 8] = 1


def _declare(lib: ctypes.CDLL) -> Any:
    fn = lib.pdserve_shm_allreduce_f32
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                   ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                   ctypes.c_double]
    fn.restype = ctypes.c_int
    return fn


class Group:
    """This process's place in a worker's tensor-parallel group (`TensorParallel` in model.py)."""

    def __init__(self, rank: int, size: int):
        self.rank = rank
        self.size = size
        self.timer = Timer()
        self.shared: SharedReduce | None = None  # None: every all-reduce over gloo
        self._peers: list[socket.socket] = []  # rank 0: a socket to each other rank

    def connect(self, peers: list[socket.socket]) -> None:
        """Rank 0: the sockets its steps go to the other ranks on (rank r's at r - 1)."""
        self._peers = peers

    def hang_up(self) -> None:
        """Rank 0: close every other rank's socket (they see it and exit)."""
        for peer in self._peers:
            peer.close()

    def start_step(self, batch: Batch) -> None:
        """Rank 0: hand `batch` to every other rank."""
        message = encode_batch(batch)
        for peer in self._peers:
            try:
                peer.sendall(message)
            except OSError as exc:
                raise RankFailed(f"tensor-parallel rank {self._peers.index(peer) + 1} is gone "
                                 f"({exc})") from None

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        started = time.perf_counter()
        shared = self.shared
        if shared is not None and shared.takes(t):
            shared.all_reduce(t)
        else:
            dist.all_reduce(t)
        self.timer.seconds += time.perf_counter() - started
        self.timer.calls += 1
        return t


def encode_batch(batch: Batch) -> bytes:
    """A batch as int64s, length first: (S, N, max_pages, max_query_len, max_context,
    block_size), then its tensors in `_TENSORS` order (no pickle: ranks take nothing they
    would execute)."""
    tables = batch.block_tables
    head = [batch.num_seqs, batch.num_tokens, int(tables.shape[1]), batch.max_query_len,
            batch.max_context, batch.block_size]
    body = np.concatenate([np.asarray(head, dtype=np.int64),
                           *(getattr(batch, n).numpy().astype(np.int64, copy=False).ravel()
                             for n in _TENSORS)])
    return _LEN.pack(body.nbytes) + body.tobytes()


def receive_batch(conn: socket.socket, device: torch.device) -> Batch | None:
    """Ranks 1..: the next step's batch from rank 0 (None once rank 0 hung up)."""
    head = _read(conn, _LEN.size)
    if head is None:
        return None
    body = _read(conn, _LEN.unpack(head)[0])
    if body is None:
        return None
    values = np.frombuffer(body, dtype=np.int64)
    s, n, max_pages, max_query_len, max_context, block_size = (int(v) for v in values[:6])
    sizes = {"input_ids": (n,), "positions": (n,), "query_starts": (s + 1,),
             "context_lens": (s,), "block_tables": (s, max_pages), "slot_pages": (n,),
             "slot_offsets": (n,), "last_index": (s,)}
    tensors, at = {}, 6
    for name in _TENSORS:
        count = int(np.prod(sizes[name]))
        tensors[name] = torch.from_numpy(values[at:at + count].reshape(sizes[name]).copy()
                                         ).to(device)
        at += count
    if at != len(values):
        raise RankFailed(f"a batch from rank 0 of {len(values)} values, expected {at}")
    return Batch(**tensors, max_query_len=max_query_len, max_context=max_context,
                 block_size=block_size)


def _read(conn: socket.socket, n: int) -> bytes | None:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = conn.recv_into(view[got:])
        if k == 0:
            return None
        got += k
    return bytes(buf)


class Ranks:
    """Rank 0's handle on ranks 1..N-1: started by `launch`, stopped by `close`."""

    def __init__(self, group: Group, procs: list[subprocess.Popen[bytes]],
                 pools: list[KVPool]):
        self.group = group
        self.procs = procs
        self.pools = pools  # ranks 1..'s pools, made here, mapped by their ranks too
        self._closing = False
        self.on_death: Callable[[int, int], None] = self._log_death

    @classmethod
    def launch(cls, group: Group, spec: RankSpec, cores: list[list[int]],
               pools: list[KVPool], *, timeout_s: float = 300.0) -> Ranks:
        """Start ranks 1.. on `cores[1:]`, each mapping its pool of `pools` (made here, so
        this process can hand every rank's pool to the agent), join the group with them
        (`group` is this process, rank 0), wait until each has its shard. RankFailed naming the
        rank that did not; the pools are closed then."""
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # a worker's ranks share a host
        timeout = datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S)
        store = TCPStore("127.0.0.1", 0, spec.size, is_master=True, timeout=timeout,
                              wait_for_workers=False)
        spec = RankSpec(**{**asdict(spec), "store_port": store.port})
        procs: list[subprocess.Popen[bytes]] = []
        peers: list[socket.socket] = []
        ranks = cls(group, procs, pools)
        try:
            shared_fd = -1
            if spec.slot_bytes:
                segment = SharedSegment.create(
                    SharedReduce.segment_bytes(spec.size, spec.slot_bytes), tag="tp")
                group.shared = SharedReduce(segment, 0, spec.size, spec.slot_bytes)
                shared_fd = segment.fd
            for rank, pool in enumerate(pools, start=1):
                mine, theirs = socket.socketpair()
                peers.append(mine)
                fds = (theirs.fileno(), pool.fd, *((shared_fd,) if shared_fd >= 0 else ()))
                procs.append(subprocess.Popen(
                    [sys.executable, "-m", "pdserve.engine.tp_rank", str(rank),
                     str(theirs.fileno()), str(pool.fd), str(shared_fd),
                     json.dumps(asdict(spec))],
                    pass_fds=fds, preexec_fn=_rank_setup(cores[rank])))
                theirs.close()
            group.connect(peers)
            ranks._join(store, timeout_s)
            for rank, peer in enumerate(peers, start=1):
                ranks._await_ready(rank, peer, timeout_s)
        except BaseException:
            ranks.close()
            raise
        for rank, proc in enumerate(procs, start=1):
            threading.Thread(target=ranks._watch, args=(rank, proc), daemon=True,
                             name=f"tp-rank-{rank}-watch").start()
        return ranks

    def _join(self, store: TCPStore, timeout_s: float) -> None:
        """init_process_group as rank 0, watching the other ranks while it waits for them."""
        failure: list[BaseException] = []

        def join() -> None:
            try:
                dist.init_process_group(
                    "gloo", store=store, rank=0, world_size=self.group.size,
                    timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
                failure.append(exc)

        joiner = threading.Thread(target=join, name="tp-join", daemon=True)
        joiner.start()
        deadline = time.monotonic() + timeout_s
        while joiner.is_alive():
            self._check_alive()
            if time.monotonic() > deadline:
                raise RankFailed(f"tensor-parallel ranks did not join within {timeout_s:.0f} s")
            joiner.join(0.05)
        if failure:
            raise RankFailed(f"tensor-parallel group could not form: {failure[0]}")

    def _check_alive(self) -> None:
        for rank, proc in enumerate(self.procs, start=1):
            if proc.poll() is not None:
                raise RankFailed(f"tensor-parallel rank {rank} (pid {proc.pid}) exited with "
                                 f"code {proc.returncode} while starting; its error is above")

    def _await_ready(self, rank: int, peer: socket.socket, timeout_s: float) -> None:
        peer.settimeout(timeout_s)
        try:
            line = _read(peer, 1)
        except TimeoutError:
            raise RankFailed(f"tensor-parallel rank {rank} not ready within {timeout_s:.0f} s"
                             ) from None
        finally:
            peer.settimeout(None)
        if line != b"R":
            self._check_alive()
            raise RankFailed(f"tensor-parallel rank {rank} hung up while loading")

    def _watch(self, rank: int, proc: subprocess.Popen[bytes]) -> None:
        code = proc.wait()
        if not self._closing:
            if self.group.shared is not None:  # no rank waits for it in an all-reduce
                self.group.shared.abort()
            self.on_death(rank, code)

    @staticmethod
    def _log_death(rank: int, code: int) -> None:
        log.error("tensor-parallel rank %d exited (code %d)", rank, code)

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop every other rank (hang up, then SIGTERM, then SIGKILL) and leave the group."""
        self._closing = True
        self.group.hang_up()
        if self.group.shared is not None:
            self.group.shared.abort()
        deadline = time.monotonic() + timeout_s
        for proc in self.procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.terminate()
                try:
                    proc.wait(2.0)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        if dist.is_initialized():
            dist.destroy_process_group()
        for pool in self.pools:
            pool.close()
        if self.group.shared is not None:
            self.group.shared.segment.close()
            self.group.shared = None


def _rank_setup(cpus: list[int]) -> Callable[[], None]:
    """In a rank's process before it runs: its cores, and SIGKILL when rank 0 dies."""
    def setup() -> None:
        os.sched_setaffinity(0, cpus)
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        except OSError:
            pass
    return setup
