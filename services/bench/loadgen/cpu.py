"""The CPU time a server process spends, read from /proc (Linux), for `--server-cpu`: which
process listens on a local port, and its user + system CPU seconds so far (all threads)."""

from __future__ import annotations

import os
from pathlib import Path

LISTEN = "0A"  # TCP state in /proc/net/tcp*


def _listening_inodes(port: int) -> set[str]:
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state == LISTEN and int(local.rsplit(":", 1)[1], 16) == port:
                inodes.add(inode)
    return inodes


def pid_listening_on(address: str) -> int:
    """The pid of the process listening on `address` (HOST:PORT, or a URL with a port) on this
    machine. Raises ValueError when none of this user's processes does."""
    text = address.split("://", 1)[-1].split("/", 1)[0]
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"--server-cpu {address!r}: expected HOST:PORT")
    wanted = {f"socket:[{inode}]" for inode in _listening_inodes(int(port))}
    if wanted:
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit():
                continue
            try:
                for fd in (proc / "fd").iterdir():
                    if os.readlink(fd) in wanted:
                        return int(proc.name)
            except OSError:  # gone, or not ours
                continue
    raise ValueError(f"--server-cpu {address!r}: no process of this user listens on port {port}")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process `pid` so far, in seconds."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) "
    utime, stime = int(fields[11]), int(fields[12])  # fields 14 and 15 of stat(5)
    return (utime + stime) / os.sysconf("SC_CLK_TCK")
