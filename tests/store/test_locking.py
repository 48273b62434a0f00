"""The finalizer-safe lock (shardcache/store/locking.py)."""

from __future__ import annotations

import threading

from shardcache.store.locking import DeferredLock


def test_work_runs_at_once_when_the_lock_is_free():
    lock, done = DeferredLock(), []
    lock.run_or_defer(lambda: done.append(1))
    assert done == [1] and lock.pending == 0


def test_work_queued_by_the_holding_thread_runs_in_order_when_it_leaves():
    # what a finalizer run by the garbage collector inside the locked region does: it must
    # neither wait (it would wait for itself) nor be lost
    lock, done = DeferredLock(), []
    with lock:
        lock.run_or_defer(lambda: done.append("a"))
        lock.run_or_defer(lambda: done.append("b"))
        assert done == [] and lock.pending == 2
    assert done == ["a", "b"] and lock.pending == 0


def test_work_queued_while_the_queue_runs_runs_too():
    lock, done = DeferredLock(), []

    def first() -> None:
        done.append(1)
        lock.run_or_defer(lambda: done.append(2))  # e.g. a finalizer run by the first work

    with lock:
        lock.run_or_defer(first)
    assert done == [1, 2] and lock.pending == 0


def test_another_thread_never_waits_and_the_holder_runs_its_work():
    lock, done = DeferredLock(), []
    inside, leave = threading.Event(), threading.Event()

    def holder() -> None:
        with lock:
            inside.set()
            leave.wait()

    thread = threading.Thread(target=holder)
    thread.start()
    inside.wait()
    lock.run_or_defer(lambda: done.append(threading.current_thread().name))  # returns at once
    assert done == [] and lock.pending == 1
    leave.set()
    thread.join()
    assert done == [thread.name] and lock.pending == 0


def test_reset_gives_a_free_lock_without_the_queue():
    lock, done = DeferredLock(), []
    lock.__enter__()  # as a forked child finds a lock some parent thread held
    lock.run_or_defer(lambda: done.append(1))
    lock.reset()
    assert lock.pending == 0
    with lock:
        pass
    assert done == []
