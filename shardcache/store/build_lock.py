"""The build lock: one live build per output folder.

``<output>/.lock`` holds ``{"pid", "host", "started"}`` JSON, written to a private temporary file,
fsynced, then hard-linked into place (``link`` fails if the name exists): never half-written.
A lock of this host whose pid is dead is stale and is taken over with exactly one winner: under
an exclusive ``flock`` on ``.lock.takeover`` (else B could move aside the live lock A just took),
the lock is renamed aside and re-read, deleted only if it is still the lock judged stale, and
otherwise linked back. A live lock is never broken (``--force`` included); another host's lock
cannot be checked, and a reused pid makes a stale lock look live, so errors name pid, host and
start time for a person to decide. A job-array share holds ``.shares/share-i-of-N/.lock``;
``refuse_colliding_builds`` then refuses a full build beside a share or shares of different N.
Each side takes its own lock before looking for the other's, so of two racing starts at least
one sees the other.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import socket
import time
from typing import Any

from shardcache.errors import BuildLockedError
from shardcache.store.layout import SHARES_DIR, parse_share_name

LOCK_NAME = ".lock"
TAKEOVER_NAME = ".lock.takeover"


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists on this host (also when another user owns it)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


#: Name prefixes of the scratch files and folders a process leaves only when it is killed:
#: each is followed by the owner's pid and ``-`` (``shardcache-commit-1234-...``).
SCRATCH_PREFIXES = ("shardcache-commit-", "shardcache-part-", "shardcache-pool-", "verify-")


def sweep_dead_scratch(folder: str, prefixes: tuple[str, ...] = SCRATCH_PREFIXES) -> list[str]:
    """Remove the ``<prefix><pid>-...`` entries of ``folder`` whose pid is dead; return their paths.

    Such scratch files and folders are left only by processes killed on this host.
    """
    removed = []
    with contextlib.suppress(OSError), os.scandir(folder) as entries:
        for entry in entries:
            prefix = next((p for p in prefixes if entry.name.startswith(p)), None)
            if prefix is None:
                continue
            pid = entry.name[len(prefix) :].split("-", 1)[0]
            if not pid.isdigit() or pid_alive(int(pid)):
                continue
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path, ignore_errors=True)
            else:
                with contextlib.suppress(OSError):
                    os.remove(entry.path)
            removed.append(entry.path)
    return removed


def read_owner(path: str) -> dict[str, Any] | None:
    """The content of the lock file ``path``: None when there is none, ``{}`` when unreadable."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _lock_guard(path: str) -> int:
    """Take an exclusive ``flock`` on ``path`` (created if needed) and return its descriptor.

    The holder deletes the file before closing it, so a waiter that locked a deleted file
    retries on the current one (inode check).
    """
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            if os.fstat(fd).st_ino == os.stat(path).st_ino:
                return fd
        except FileNotFoundError:
            pass
        os.close(fd)


class BuildLock:
    """``with BuildLock(output):`` holds ``output/.lock`` for the duration of a build."""

    def __init__(self, output: str):
        self.output = output
        self.path = os.path.join(output, LOCK_NAME)
        self.held = False

    def acquire(self) -> None:
        """Take the lock (taking over a dead local build's), else raise ``BuildLockedError``."""
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
        """Take over a stale lock, or raise ``BuildLockedError`` naming the live holder."""
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
        if host == socket.gethostname() and not pid_alive(pid):
            self._take_over(holder)
            return
        where = "this host" if host == socket.gethostname() else f"host {host!r}"
        raise BuildLockedError(
            f"{self.output!r} is being built by another process (pid {pid} on {where}, "
            f"started {since}); two builds cannot write one output: wait for it, stop it, or "
            f"choose another --output (if that build is gone, delete {self.path})"
        )

    def _take_over(self, stale: dict[str, Any]) -> None:
        """Delete the lock if it still is ``stale``; the caller then retries the link."""
        guard_path = os.path.join(self.output, TAKEOVER_NAME)
        guard = _lock_guard(guard_path)
        try:
            if read_owner(self.path) != stale:
                return  # taken over or released meanwhile: retry from the start
            aside = f"{self.path}.stale-{os.getpid()}-{os.urandom(4).hex()}"
            try:
                os.rename(self.path, aside)
            except FileNotFoundError:
                return
            if read_owner(aside) == stale:
                os.remove(aside)
                return
            # not the lock judged stale: put it back, never break a live lock
            # (FileExistsError: someone linked a new lock meanwhile; it stands, we refuse)
            with contextlib.suppress(FileExistsError):
                os.link(aside, self.path)
            os.remove(aside)
            holder = read_owner(self.path) or {}
            raise BuildLockedError(
                f"{self.output!r} was taken by another build (pid {holder.get('pid')}) while "
                "this one replaced a stale lock; two builds cannot write one output: wait for "
                f"it, stop it, or choose another --output (if that build is gone, delete "
                f"{self.path})"
            )
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.remove(guard_path)  # still held: a waiter sees the unlink and reopens
            os.close(guard)

    def release(self) -> None:
        """Remove the lock if this process holds it (idempotent)."""
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


def _live_holder(path: str) -> dict[str, Any] | None:
    """The holder of lock ``path`` unless absent, unreadable, ours, or a dead pid of this host.

    Another host's holder counts as alive: it cannot be checked.
    """
    holder = read_owner(path)
    if not holder or not isinstance(holder.get("pid"), int):
        return None
    host = holder.get("host")
    if host == socket.gethostname() and (
        holder["pid"] == os.getpid() or not pid_alive(holder["pid"])
    ):
        return None
    return holder


def _describe(share: tuple[int, int] | None) -> str:
    """Name a build for messages: a full build, or share i/N."""
    return "a full build (or commit)" if share is None else f"share {share[0]}/{share[1]}"


def refuse_colliding_builds(root: str, name: str) -> None:
    """Raise ``BuildLockedError`` if a live build of ``root`` would collide with this one.

    ``name`` is the lock this build holds relative to ``root`` (``""``: full build or commit). A
    full build collides with any share, and shares collide when their N differs.
    """
    mine = parse_share_name(os.path.basename(name)) if name else None
    running: list[tuple[tuple[int, int] | None, dict[str, Any]]] = []
    if mine is not None:
        holder = _live_holder(os.path.join(root, LOCK_NAME))
        if holder is not None:
            running.append((None, holder))
    with contextlib.suppress(OSError), os.scandir(os.path.join(root, SHARES_DIR)) as entries:
        for entry in entries:
            other = parse_share_name(entry.name)
            if other is None or other == mine or (mine is not None and other[1] == mine[1]):
                continue
            holder = _live_holder(os.path.join(entry.path, LOCK_NAME))
            if holder is not None:
                running.append((other, holder))
    if not running:
        return
    other, holder = running[0]
    host = holder.get("host")
    where = "this host" if host == socket.gethostname() else f"host {host!r}"
    if mine is None:
        advice = ("wait for the shares to finish and run `shardcache commit`, or stop them "
                  "and delete the output's .shares folder")  # fmt: skip
    elif other is None:
        advice = "wait for it to finish (it builds every partition), or stop it first"
    else:
        advice = (f"every share of one output must use the same N: run --partition i/{other[1]}, "
                  "or stop those shares first")  # fmt: skip
    raise BuildLockedError(
        f"{root!r}: {_describe(mine)} cannot start while {_describe(other)} runs (pid "
        f"{holder['pid']} on {where}; {len(running)} running build(s) in all): they would "
        f"remove or rebuild each other's files; {advice}"
    )


def _holder_place(holder: dict[str, Any]) -> str:
    """``pid 12 on this host, started 2025-01-02 03:04:05`` for messages."""
    host, started = holder.get("host"), holder.get("started")
    where = "this host" if host == socket.gethostname() else f"host {host!r}"
    since = (
        f", started {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(started))}"
        if isinstance(started, (int, float)) and started > 0
        else ""
    )
    return f"pid {holder['pid']} on {where}{since}"


def running_build(root: str) -> str | None:
    """What a reader of ``root`` is told when a live build holds it (its pid, what to do), or None.

    Unlike a build's own checks this counts this process's lock too; another host's lock counts
    as live (it cannot be checked), so it is named with its host.
    """

    def live(path: str) -> dict[str, Any] | None:
        holder = read_owner(path)
        if not holder or not isinstance(holder.get("pid"), int):
            return None
        if holder.get("host") == socket.gethostname() and not pid_alive(holder["pid"]):
            return None
        return holder

    holder = live(os.path.join(root, LOCK_NAME))
    if holder is not None:
        return (
            f"a build is running there ({_holder_place(holder)}); wait for it to finish (the "
            "manifest is written last), or stop it and rerun the same build to resume it"
        )
    with contextlib.suppress(OSError), os.scandir(os.path.join(root, SHARES_DIR)) as entries:
        for entry in sorted(entries, key=lambda e: e.name):
            share = parse_share_name(entry.name)
            holder = live(os.path.join(entry.path, LOCK_NAME)) if share else None
            if share is not None and holder is not None:
                return (
                    f"share {share[0]}/{share[1]} of a job-array build is running there "
                    f"({_holder_place(holder)}); when every share is done, run "
                    f"`shardcache commit {root}`"
                )
    return None
