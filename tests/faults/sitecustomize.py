"""The kill hook of the build's crash tests, installed in every Python process started with
this folder on ``PYTHONPATH`` (a build started by a test, its pool workers, Ray workers):
Python imports ``sitecustomize`` at start-up. Tests set it up with ``conftest.kill_env``.

``SHARDCACHE_TEST_KILL="<event>:<n>"`` SIGKILLs the build (from a pool worker: its parent
too) at the n-th pass of the fault point ``<event>`` in a process
(:mod:`shardcache.builder.fault_points`); ``<event>:<n>:INT`` sends SIGINT (Ctrl-C) to the
build process instead. With ``SHARDCACHE_TEST_KILL_ONCE=<path>`` the kill happens only if
``path`` does not exist yet (it is created first): a retried task (Ray) then runs through.
"""

from __future__ import annotations

import os

SPEC = os.environ.get("SHARDCACHE_TEST_KILL")


def _install(spec: str, once: str | None) -> None:
    import signal
    from collections import Counter

    from shardcache.builder import fault_points, partition

    counts: Counter[str] = Counter()

    def kill(event: str) -> None:
        counts[event] += 1
        if spec == f"{event}:{counts[event]}:INT":
            os.kill(partition.build_pid(), signal.SIGINT)
            return
        if spec != f"{event}:{counts[event]}":
            return
        if once:
            try:
                os.close(os.open(once, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            except FileExistsError:
                return  # killed once already
        if partition.build_pid() != os.getpid():
            os.kill(partition.build_pid(), signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)

    fault_points.hook = kill


if SPEC:
    _install(SPEC, os.environ.get("SHARDCACHE_TEST_KILL_ONCE"))
