"""UCX transport (default): tagged messages between agents' UCX workers.

Endpoints are built from worker addresses that agents publish over gRPC (`AgentInfo`), never
through a UCX listener, and without UCX peer-error handling: only then does UCX pick shared
memory and CMA between processes on one host (measured here: ~4.5 GB/s against ~1.2 GB/s over
loopback TCP). Peer failure is the control plane's job: every wait is bounded and the sender
asks `liveness()` about once a second. The price of the fast path: a peer that dies in the
middle of a CMA copy can take this process down with it (UCX aborts on the failed copy); run
with `error_handling=True` to trade the shared-memory path for UCX's own failure handling.

Protocol (64-bit tags: 4 bits kind, 36 bits transfer id, 24 bits run index):
- The receiver keeps one receive posted for HEADER on its worker. The header carries the
  sender's worker address; the receiver builds (and caches) an endpoint back to it.
- The receiver answers READY (or a refusal) on the READY tag, having first posted one receive
  per run, straight into the destination pages (DATA tags); the sender then sends the runs
  from its pool's pages, and the receiver answers DONE once every receive completed.
- A posted receive that nobody should fill any more (cancel, timeout) is retired with a
  zero-length message from this worker to itself; a one-byte receive then swallows whichever
  message of the two comes second (a late real one is truncated, which also frees its sender).
One Python thread drives the worker (`_progress_loop`, UCX's blocking progress mode): it sleeps
in epoll on the worker's descriptor with the GIL released, progresses when the network wakes it,
and then wakes each thread whose request completed (a `threading.Event`), so no thread polls.
Other threads post their requests straight to UCX (ucxx workers are UCS_THREAD_MODE_MULTI;
no delayed submission, which only ucxx's own progress thread would carry out). Against ucxx's
progress thread with requests polled from Python (back to back across a veth,
docs/kv-transfer.md): one page 1.66 -> 0.90 ms in the agents, 24 MiB 1.49 -> 2.21 GB/s.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

import numpy as np
from pdserve.common.kv.errors import (
    KvTransferError,
    PeerUnavailable,
    TransferTimeout,
)
from pdserve.common.kv.wire import (
    LIVENESS_INTERVAL_S,
    MAX_HEADER_BYTES,
    PREFIX_BYTES,
    REPLY_BYTES,
    Reply,
    WriteHeader,
)
from pdserve.kvtransfer.transport import (
    IncomingWrite,
    Liveness,
    PeerContact,
    Transport,
    WriteSink,
    receive_deadline_s,
)

log = logging.getLogger("pdserve.kvtransfer.ucx")

_HEADER, _READY, _DONE, _DATA = 1, 2, 3, 4
_EMPTY = np.empty(0, dtype=np.uint8)
# The progress loop's epoll wait, ms: the longest a request posted from another thread while the
# loop sleeps can wait for a progress that no network event triggers (the retiring self-sends).
EPOLL_TIMEOUT_MS = 20
# Handoffs up to this size send their runs right behind the header, without waiting for READY
# (one round trip less for a short prompt's pages); a refused one's runs are swallowed. Across a
# veth: 0.75 MiB 1.02-1.12 ms against 1.43-1.58 waiting for READY (docs/kv-transfer.md).
EAGER_BYTES = 1 << 20
WAIT_SLICE_S = 0.01  # a waiter re-checks its deadline, abort and the peer's liveness this often
RETIRE_WAIT_S = 5.0


def _tag(kind: int, xfer_id: int = 0, run: int = 0) -> int:
    return (kind << 60) | ((xfer_id & ((1 << 36) - 1)) << 24) | run


def _finished(req: Any, logger: logging.Logger) -> bool:
    """True once a fire-and-forget request completed (a failure is logged, not raised)."""
    if not req.completed:
        return False
    try:
        req.check_error()
    except Exception as exc:  # UCX errors of a reply nobody waits for: the sender times out
        logger.warning("a reply to a sender failed: %s", exc)
    return True


class _Aborted(Exception):
    pass


class UcxTransport(Transport):
    """Handoffs over UCX tagged messages (see the module docstring)."""

    name = "ucx"

    def __init__(self, *, error_handling: bool = False, receive_threads: int = 8):
        self._error_handling = error_handling
        self._receive_threads = receive_threads
        self._stopping = threading.Event()
        self._progress_stop = threading.Event()  # set last: closing still needs progress
        self._eps: dict[bytes, Any] = {}
        self._eps_lock = threading.Lock()
        self._drains: list[tuple[Any, np.ndarray]] = []  # receives that swallow stragglers
        self._replies: list[tuple[Any, np.ndarray]] = []  # replies not yet known sent
        self._drains_lock = threading.Lock()
        self._watched: list[tuple[Any, threading.Event]] = []  # see _progress_loop
        self._watched_lock = threading.Lock()
        self._address = b""
        self._sink: WriteSink | None = None
        self._progress: threading.Thread | None = None
        self._executor: ThreadPoolExecutor | None = None

    # ---- lifecycle --------------------------------------------------------------------
    def start(self, sink: WriteSink) -> PeerContact:
        import ucxx._lib.libucxx as ucx_api  # loaded only when UCX is used
        from ucxx._lib.arr import Array

        self._api, self._array = ucx_api, Array
        self._sink = sink
        self._ctx = ucx_api.UCXContext({"WARN_UNUSED_ENV_VARS": "n"},
                                       feature_flags=(ucx_api.Feature.TAG, ucx_api.Feature.WAKEUP))
        self._worker = ucx_api.UCXWorker(self._ctx, enable_delayed_submission=False)
        self._worker.init_blocking_progress_mode()
        self._address = bytes(self._worker.address.tobytes())
        self._self_ep = self._endpoint(self._address)
        self._executor = ThreadPoolExecutor(self._receive_threads, thread_name_prefix="kv-ucx-recv")
        self._progress = threading.Thread(target=self._progress_loop, name="kv-ucx-progress",
                                          daemon=True)
        self._progress.start()
        log.info("UCX worker ready (error handling %s, address %d bytes)",
                 "on" if self._error_handling else "off", len(self._address))
        return PeerContact(agent_id="", ucx_worker_address=self._address)

    def close(self) -> None:
        if self._stopping.is_set() or self._progress is None:
            return
        self._stopping.set()  # every wait gives up within WAIT_SLICE_S
        wake = self._send(self._self_ep, _EMPTY, _tag(_HEADER))  # completes the posted receive
        if self._executor is not None:  # receives still landing retire theirs (bounded)
            self._executor.shutdown(wait=True, cancel_futures=True)
        self._progress_stop.set()
        self._progress.join(timeout=2.0)
        del wake

    def forget(self, peer: PeerContact) -> None:
        with self._eps_lock:  # not closed: closing an endpoint also tears down the peer's side
            self._eps.pop(peer.ucx_worker_address, None)

    # ---- sending ----------------------------------------------------------------------
    def send(self, peer: PeerContact, header: WriteHeader, src_views: Sequence[np.ndarray],
             timeout_s: float, liveness: Liveness | None = None) -> None:
        deadline = time.monotonic() + timeout_s
        ep = self._endpoint(peer.ucx_worker_address)
        header = replace(header, reply_to=self._address)
        xfer = header.xfer_id
        header_buf = np.frombuffer(header.encode(), dtype=np.uint8)  # alive until sent
        if header.kv_bytes <= EAGER_BYTES:
            self._send_eager(ep, xfer, header_buf, src_views, deadline, liveness)
            return
        ready_buf = np.zeros(REPLY_BYTES, dtype=np.uint8)
        ready = self._recv(ready_buf, _tag(_READY, xfer))
        try:
            self._wait([self._send(ep, header_buf, _tag(_HEADER))], deadline,
                       doing="sending the header")
            self._wait([ready], deadline, liveness=liveness,
                       doing=f"waiting for agent {peer.agent_id or '?'} to accept the handoff")
        except KvTransferError:
            self._retire([(ready, _tag(_READY, xfer))], REPLY_BYTES)
            raise
        Reply.decode(ready_buf.data).raise_if_error()
        done_buf = np.zeros(REPLY_BYTES, dtype=np.uint8)
        done = self._recv(done_buf, _tag(_DONE, xfer))
        sends = [self._send(ep, view, _tag(_DATA, xfer, i)) for i, view in enumerate(src_views)]
        self._wait_done(done, done_buf, xfer, deadline, liveness)
        self._wait(sends, time.monotonic() + 1.0, doing="completing the sends")

    def _send_eager(self, ep: Any, xfer: int, header_buf: np.ndarray,
                    src_views: Sequence[np.ndarray], deadline: float,
                    liveness: Liveness | None) -> None:
        """A small handoff: the runs go right behind the header, without waiting for READY;
        the one reply (DONE, or the refusal) comes once the receiver is through."""
        done_buf = np.zeros(REPLY_BYTES, dtype=np.uint8)
        done = self._recv(done_buf, _tag(_DONE, xfer))
        sends = [(self._send(ep, header_buf, _tag(_HEADER)), header_buf)]
        sends += [(self._send(ep, view, _tag(_DATA, xfer, i)), view)
                  for i, view in enumerate(src_views)]
        try:
            self._wait_done(done, done_buf, xfer, deadline, liveness)
        finally:  # a refused handoff's runs are swallowed by the receiver, so they complete too
            self._hold_sends([(r, b) for r, b in sends if not r.completed])
        self._wait([r for r, _ in sends], time.monotonic() + 1.0, doing="completing the sends")

    def _wait_done(self, done: Any, done_buf: np.ndarray, xfer: int, deadline: float,
                   liveness: Liveness | None) -> None:
        try:
            self._wait([done], deadline, liveness=liveness, doing="moving the handoff's bytes")
        except KvTransferError:
            self._retire([(done, _tag(_DONE, xfer))], REPLY_BYTES)
            raise
        Reply.decode(done_buf.data).raise_if_error()

    # ---- receiving --------------------------------------------------------------------
    def _take_header(self, req: Any, buf: np.ndarray) -> None:
        """A header arrived (on the progress thread): check it and post its receives, or refuse
        it, right here (the critical path); never wait for anything here."""
        try:
            req.check_error()
            header = WriteHeader.decode(buf[:WriteHeader.size(bytes(buf[:PREFIX_BYTES]))].data)
            ep = self._endpoint(header.reply_to)
        except (self._api.UCXError, KvTransferError) as exc:
            log.warning("dropped a KV header that cannot be answered: %s", exc)
            return
        self._accept(header, ep)

    def _accept(self, header: WriteHeader, ep: Any) -> None:
        assert self._sink is not None and self._executor is not None
        xfer, eager = header.xfer_id, header.kv_bytes <= EAGER_BYTES
        try:
            write = self._sink.accept(header)
        except KvTransferError as exc:
            if eager:  # its runs are on their way: swallowed, so the sender's sends complete
                scratch = [np.empty(n * header.page_bytes, dtype=np.uint8)
                           for _, n in header.dst_runs]
                self._hold_drains([(self._recv(buf, _tag(_DATA, xfer, i)), buf)
                                   for i, buf in enumerate(scratch)])
            self._post_reply(ep, _tag(_DONE if eager else _READY, xfer),
                             Reply.failure("ready", exc))
            return
        recvs = [(self._recv(view, _tag(_DATA, xfer, i)), _tag(_DATA, xfer, i))
                 for i, view in enumerate(write.dst_views)]
        if not eager:
            self._post_reply(ep, _tag(_READY, xfer), Reply("ready"))
        elif all(r.completed for r, _ in recvs):  # its bytes came with the header: land now
            self._land(write, recvs, ep)
            return
        self._executor.submit(self._land, write, recvs, ep)

    def _land(self, write: IncomingWrite, recvs: list[tuple[Any, int]], ep: Any) -> None:
        """Wait until every run landed (or the ticket is cancelled); then answer DONE."""
        assert self._sink is not None
        deadline = time.monotonic() + receive_deadline_s(write.header)
        ok, error = False, None
        try:
            self._wait([r for r, _ in recvs], deadline, abort=write.abort,
                       doing="waiting for the handoff's bytes")
            ok = True
        except _Aborted:
            pass
        except KvTransferError as exc:
            error = exc
        finally:
            if not ok:  # nothing may land in the pages once finish() is called
                self._retire(recvs, 1, max(RETIRE_WAIT_S, deadline - time.monotonic()))
        try:
            self._sink.finish(write, ok)
        except KvTransferError as exc:
            error = error or exc
        if error is None and not ok:
            error = TransferTimeout("the handoff stopped before all bytes arrived")
        self._post_reply(ep, _tag(_DONE, write.header.xfer_id),
                         Reply("done") if error is None else Reply.failure("done", error))

    def _post_reply(self, ep: Any, tag: int, reply: Reply) -> None:
        """Send a reply without waiting; its buffer is kept until the send completed."""
        msg = np.frombuffer(reply.encode(), dtype=np.uint8)
        self._hold_sends([(self._send(ep, msg, tag), msg)])

    def _hold_sends(self, sends: list[tuple[Any, np.ndarray]]) -> None:
        """Keep these sends' buffers until the sends complete (dropping those that did)."""
        with self._drains_lock:
            self._replies = [(r, b) for r, b in self._replies if not _finished(r, log)] + sends

    def _hold_drains(self, drains: list[tuple[Any, np.ndarray]]) -> None:
        """Keep these swallowing requests and their buffers until they complete."""
        with self._drains_lock:
            self._drains = [(r, b) for r, b in self._drains if not r.completed] + drains

    # ---- UCX plumbing -----------------------------------------------------------------
    def _progress_loop(self) -> None:
        """Progress the worker whenever the network (or the epoll timeout) wakes it; take the
        headers that arrived; then wake the threads whose requests completed."""
        buf = np.zeros(MAX_HEADER_BYTES, dtype=np.uint8)
        header = self._recv(buf, _tag(_HEADER))
        while not self._progress_stop.is_set():
            try:
                self._worker.progress_worker_event(EPOLL_TIMEOUT_MS)
            except self._api.UCXError as exc:  # waiters time out; this loop must go on
                log.error("UCX progress failed: %s", exc)
                time.sleep(EPOLL_TIMEOUT_MS / 1e3)
            while header.completed and not self._stopping.is_set():
                try:
                    self._take_header(header, buf)
                except Exception:  # a bug must not stop this worker's progress
                    log.exception("a KV header could not be taken")
                header = self._recv(buf, _tag(_HEADER))
            if self._watched:
                with self._watched_lock:
                    pending = []
                    for req, woken in self._watched:
                        if req.completed:
                            woken.set()
                        else:
                            pending.append((req, woken))
                    self._watched = pending

    def _watch(self, reqs: Sequence[Any], woken: threading.Event) -> None:
        """Have the progress loop set `woken` when any of `reqs` completes."""
        with self._watched_lock:
            self._watched.extend((req, woken) for req in reqs)

    def _unwatch(self, woken: threading.Event) -> None:
        with self._watched_lock:
            self._watched = [(r, w) for r, w in self._watched if w is not woken]

    def _endpoint(self, address: bytes) -> Any:
        with self._eps_lock:
            ep = self._eps.get(address)
        if ep is not None:
            return ep
        if not address:
            raise PeerUnavailable("the peer published no UCX worker address (is it a TCP agent?)")
        try:
            ep = self._worker.create_endpoint_from_worker_address(
                self._api.UCXAddress.create_from_buffer(address), self._error_handling)
        except self._api.UCXError as exc:
            raise PeerUnavailable(f"cannot reach the peer's UCX worker: {exc}",
                                  retryable=True) from None
        with self._eps_lock:
            return self._eps.setdefault(address, ep)

    def _recv(self, buf: np.ndarray, tag: int) -> Any:
        return self._worker.tag_recv(self._array(buf), self._api.UCXXTag(tag))

    def _send(self, ep: Any, buf: np.ndarray, tag: int) -> Any:
        return ep.tag_send(self._array(buf), self._api.UCXXTag(tag))

    def _wait(self, reqs: Sequence[Any], deadline: float, *, doing: str,
              abort: threading.Event | None = None, liveness: Liveness | None = None,
              shutdown_ends: bool = True) -> None:
        """Wait until every request completed; bounded by `deadline`, cut short by `abort` (and
        by the agent's shutdown unless `shutdown_ends` is False)."""
        pending, woken = [r for r in reqs if not r.completed], threading.Event()
        next_check = time.monotonic() + LIVENESS_INTERVAL_S
        self._watch(pending, woken)
        try:
            while True:
                woken.clear()  # before the check: a completion after it sets `woken` again
                pending = [r for r in pending if not r.completed]
                if not pending:
                    break
                if abort is not None and abort.is_set():
                    raise _Aborted()
                now = time.monotonic()
                if now >= deadline:
                    raise TransferTimeout(f"timed out {doing}")
                if shutdown_ends and self._stopping.is_set():
                    raise PeerUnavailable(f"agent shutting down while {doing}")
                if liveness is not None and now >= next_check:
                    liveness()
                    next_check = now + LIVENESS_INTERVAL_S
                woken.wait(min(WAIT_SLICE_S, deadline - now))
        finally:
            self._unwatch(woken)
        for req in reqs:
            try:
                req.check_error()
            except self._api.UCXError as exc:
                raise PeerUnavailable(f"UCX error while {doing}: {exc}") from None

    def _retire(self, reqs: Sequence[tuple[Any, int]], drain_bytes: int,
                wait_s: float = RETIRE_WAIT_S) -> None:
        """Complete posted receives nobody should fill any more (see the module docstring)."""
        drains = []
        for req, tag in reqs:
            if not req.completed:
                buf = np.empty(drain_bytes, dtype=np.uint8)
                drains += [(self._send(self._self_ep, _EMPTY, tag), _EMPTY),
                           (self._recv(buf, tag), buf)]
        self._hold_drains(drains)
        deadline = time.monotonic() + (RETIRE_WAIT_S if self._stopping.is_set() else wait_s)
        try:
            self._wait([r for r, _ in reqs], deadline, doing="retiring posted receives",
                       shutdown_ends=False)
        except KvTransferError:
            log.error("posted receives still busy %.1fs after retiring them", wait_s)
