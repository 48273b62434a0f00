"""The build lock: one live build per output folder.

``<output>/.lock`` holds ``{"pid", "host", "started"}`` (JSON). It is created atomically:
the content is written to a private temporary file, fsynced, then hard-linked to ``.lock``
(``link`` fails if the name exists), so a reader never sees a half-written lock.

A lock whose host is this machine and whose pid is not alive is *stale* (the build was
killed): it is moved aside with ``rename`` (atomic, so of two builds that find the same stale
lock only one wins) and taken over. A lock from another host cannot be checked: the error
says who holds it and how to remove it if that build is gone. ``--force`` never breaks a live
lock: two writers in one folder would corrupt it, whatever the options.

Pid reuse (a dead build's pid given to an unrelated live process) makes a stale lock look
live; the error message names the pid and start time so a person can decide and delete it.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from typing import Any

from shardcache.errors import BuildLockedError

LOCK_NAME = ".lock"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def read_owner(path: str) -> dict[str, Any] | None:
    """The lock's content; None when there is no lock; {} when it cannot be parsed."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


class BuildLock:
    """``with BuildLock(output):`` holds ``output/.lock`` for the duration of a build."""

    def __init__(self, output: str):
        self.output = output
        self.path = os.path.join(output, LOCK_NAME)
        self.held = False

    def acquire(self) -> None:
        os.makedirs(self.output, exist_ok=True)
        info = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()}
        tmp = f"{self.path}.{os.getpid()}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(info, f)
            f.flush()
            os.fsync(f.fileno())
        try:
            for _ in range(100):
                try:
                    os.link(tmp, self.path)
                except FileExistsError:
                    self._clear_stale_or_raise()
                    continue
                self.held = True
                return
            raise BuildLockedError(  # pragma: no cover - a livelock between many builds
                f"{self.path}: could not take the build lock after 100 tries; another build "
                "keeps taking it: stop the other builds and retry"
            )
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.remove(tmp)

    def _clear_stale_or_raise(self) -> None:
        holder = read_owner(self.path)
        if holder is None:
            return  # released meanwhile: retry
        pid, host = holder.get("pid"), holder.get("host")
        started = holder.get("started")
        since = (
            time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started))
            if isinstance(started, (int, float))
            else "an unknown time"
        )
        if not isinstance(pid, int) or not isinstance(host, str):
            raise BuildLockedError(
                f"{self.output!r} is locked by {self.path}, which cannot be read (content "
                f"{holder!r}); if no build is writing there, delete {self.path} and retry"
            )
        if host == socket.gethostname() and not _pid_alive(pid):
            aside = f"{self.path}.stale-{pid}-{os.getpid()}"
            with contextlib.suppress(FileNotFoundError):  # another build took it over first
                os.rename(self.path, aside)
                os.remove(aside)
            return
        where = "this host" if host == socket.gethostname() else f"host {host!r}"
        raise BuildLockedError(
            f"{self.output!r} is being built by another process (pid {pid} on {where}, "
            f"started {since}); two builds cannot write one output: wait for it, stop it, or "
            f"choose another --output (if that build is gone, delete {self.path})"
        )

    def release(self) -> None:
        if not self.held:
            return
        holder = read_owner(self.path)
        if holder and holder.get("pid") == os.getpid():
            with contextlib.suppress(FileNotFoundError):
                os.remove(self.path)
        self.held = False

    def __enter__(self) -> BuildLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
