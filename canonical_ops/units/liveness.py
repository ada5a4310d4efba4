"""Is the process that left a file behind still running? (one answer for the whole package)

A process is named by ``(pid namespace, pid, start time)``: the start time (clock ticks
after boot, from /proc) tells a pid reused by another process apart. Temp files of the
store and the engine's shared region both record it.
"""

from __future__ import annotations

import os

__all__ = ["ProcessId", "process_alive", "this_process"]

ProcessId = tuple[int, int, int]  # (pid namespace inode, pid, start ticks)


def _start_ticks(pid: int | str) -> int | None:
    """Start time of ``pid`` in clock ticks after boot; None if it is gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
        fields = data[data.rindex(b")") + 2 :].split()
        return None if fields[0] in (b"Z", b"X") else int(fields[19])
    except (OSError, ValueError, IndexError):
        return None


def _pid_namespace() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def this_process() -> ProcessId:
    """This process's ``(pid namespace, pid, start ticks)``."""
    pid = os.getpid()
    return _pid_namespace(), pid, _start_ticks(pid) or 0


def process_alive(process: ProcessId) -> bool | None:
    """True / False when known; None when it cannot be (another pid namespace, no /proc):
    the caller decides what that means (a temp file: wait for its age; a region holder: alive)."""
    namespace, pid, start = process
    own = _pid_namespace()
    if not own or _start_ticks("self") is None or (namespace and namespace != own):
        return None
    if pid <= 0:
        return False
    ticks = _start_ticks(pid)
    return ticks is not None and (not start or ticks == start)
