"""The local engine: partitions in this process, or in a ``spawn`` process pool.

The pool is ``spawn`` (fork after the tokenizer's Rayon pool started would deadlock); each
worker reads its encoder spec from a private payload file (never the spawn pipe, which blocks
on a child that died), takes an even share of the cores, and dies with the parent. A
``__main__`` read from stdin cannot be re-imported by children, so such a build is refused
before any worker starts.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import pickle
import signal
import sys
import tempfile
import threading
import time
from concurrent.futures import (
    FIRST_COMPLETED,
    FIRST_EXCEPTION,
    Future,
    ProcessPoolExecutor,
    ThreadPoolExecutor,
    wait,
)
from typing import Any

from shardcache.builder.build_plan import BuildPlan, Partition, PartitionResult
from shardcache.builder.encoders import Encoder, encoder_in_worker, encoder_spec, encodes_fast
from shardcache.builder.partition import build_partition, check_parent, set_parent_pid
from shardcache.builder.report import Progress
from shardcache.builder.tokenize import TextEncoder
from shardcache.config import default_workers
from shardcache.errors import (
    ShardcacheError,
)

_PROGRESS_INTERVAL_S = 0.2
_WORKER: dict[str, Any] = {}

#: Prefix of the workers' payload file (spec and plan); the pid lets a sweep find a dead one.
POOL_PAYLOAD_PREFIX = "shardcache-pool-"


class _QueueProgress(Progress):
    """Progress in a worker: sums events and sends them to the parent every 0.2 s."""

    def __init__(self, queue: Any):
        self.queue = queue
        self.pending = [0, 0, 0]  # bytes, documents, tokens
        self.last = time.monotonic()

    def advance(self, n_bytes: int) -> None:
        self.pending[0] += n_bytes
        self._maybe_send()

    def update(self, documents: int, tokens: int) -> None:
        self.pending[1] += documents
        self.pending[2] += tokens
        self._maybe_send()

    def _maybe_send(self) -> None:
        if time.monotonic() - self.last >= _PROGRESS_INTERVAL_S:
            self.flush()

    def flush(self) -> None:
        if any(self.pending):
            self.queue.put(tuple(self.pending))
            self.pending = [0, 0, 0]
        self.last = time.monotonic()


def _die_with_parent() -> None:
    """Linux: the kernel SIGKILLs this process when its parent dies."""
    with contextlib.suppress(Exception):
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _worker_init(payload: str, queue: Any, rayon_threads: int, parent: int) -> None:
    set_parent_pid(parent)
    # Ctrl-C reaches the whole process group: the parent stops the build and terminates the
    # workers; a worker's own KeyboardInterrupt would only print a traceback per process
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _die_with_parent()
    check_parent()  # the parent may have died before prctl
    # before the tokenizer's Rayon pool starts (on the first encode_batch)
    os.environ["RAYON_NUM_THREADS"] = str(rayon_threads)
    os.environ["FASTOKENS_BPE_THREADS"] = str(rayon_threads)  # the fast backend's own pool
    queue.cancel_join_thread()  # progress is best-effort; never block a worker's exit on it
    with open(payload, "rb") as f:
        spec, plan = pickle.load(f)
    _WORKER.update(encoder=encoder_in_worker(spec), plan=plan, queue=queue)


def _worker_run(index: int) -> dict[str, Any]:
    plan: BuildPlan = _WORKER["plan"]
    progress = _QueueProgress(_WORKER["queue"])
    result = build_partition(plan, plan.partitions[index], _WORKER["encoder"], progress)
    progress.flush()
    return result.to_message()


def _drain(queue: Any, progress: Progress) -> None:
    import queue as queue_module

    while True:
        try:
            n_bytes, documents, tokens = queue.get_nowait()
        except queue_module.Empty:
            return
        if n_bytes:
            progress.advance(n_bytes)
        if documents or tokens:
            progress.update(documents, tokens)


def unimportable_main() -> str | None:
    """The path of a ``__main__`` spawned children cannot re-import; None if they can."""
    main = sys.modules.get("__main__")
    if getattr(getattr(main, "__spec__", None), "name", None):
        return None  # imported by module name
    path = getattr(main, "__file__", None)
    if path is None:
        return None  # nothing to re-import
    original = multiprocessing.process.ORIGINAL_DIR  # what spawn joins a relative path to
    if not os.path.isabs(path) and original is not None:
        path = os.path.join(original, path)
    return None if os.path.isfile(path) else path


def check_main_importable(workers: int) -> None:
    """Raise ``ShardcacheError`` for a pool whose children would die re-importing ``__main__``."""
    path = unimportable_main()
    if path is not None:
        raise ShardcacheError(
            f"cannot start {workers} worker processes: each re-imports the main script, and "
            f"this one ({os.path.basename(path)!r}, e.g. a script read from stdin) is not a "
            "file they can import; save the script to a file with the build call under an "
            "`if __name__ == '__main__':` guard and run that file, or build with workers=1"
        )


def _write_payload(spec: dict[str, Any], plan: BuildPlan) -> str:
    """Write what every worker needs to a private temporary file; returns its path."""
    fd, path = tempfile.mkstemp(prefix=f"{POOL_PAYLOAD_PREFIX}{os.getpid()}-", suffix=".pickle")
    with os.fdopen(fd, "wb") as f:
        pickle.dump((spec, plan), f, protocol=pickle.HIGHEST_PROTOCOL)
    return path


def run_pool(
    plan: BuildPlan,
    pending: list[Partition],
    encoder: Encoder,
    progress: Progress,
    workers: int,
) -> dict[str, PartitionResult]:
    """Run ``pending`` in a ``spawn`` pool of ``workers`` processes, largest partition first.

    Frees ``encoder``'s fast backend here (workers load their own). Raises ``ShardcacheError``
    when a child cannot re-import ``__main__`` or a worker died (completed partitions are kept).
    """
    check_main_importable(workers)
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    rayon_threads = max(1, default_workers() // workers)
    spec = encoder_spec(encoder)
    # this process only waits from here on: free its fast backend (workers load their own)
    getattr(encoder, "text", encoder).fast = None
    payload = _write_payload(spec, plan)
    try:
        return _run_executor(ctx, queue, payload, plan, pending, progress, workers, rayon_threads)
    finally:
        with contextlib.suppress(OSError):
            os.remove(payload)


def _run_executor(
    ctx: Any,
    queue: Any,
    payload: str,
    plan: BuildPlan,
    pending: list[Partition],
    progress: Progress,
    workers: int,
    rayon_threads: int,
) -> dict[str, PartitionResult]:
    from concurrent.futures.process import BrokenProcessPool

    executor = ProcessPoolExecutor(
        max_workers=workers,
        mp_context=ctx,
        initializer=_worker_init,
        initargs=(payload, queue, rayon_threads, os.getpid()),
    )
    index = {p.id: i for i, p in enumerate(plan.partitions)}
    futures: dict[Future[dict[str, Any]], Partition] = {}
    results: dict[str, PartitionResult] = {}
    try:
        for p in sorted(pending, key=lambda p: (-p.nbytes, p.id)):  # largest first: no tail
            futures[executor.submit(_worker_run, index[p.id])] = p
        not_done = set(futures)
        while not_done:
            done, not_done = wait(not_done, timeout=0.1, return_when=FIRST_COMPLETED)
            _drain(queue, progress)
            for future in done:
                try:
                    data = future.result()
                except BrokenProcessPool as err:
                    raise ShardcacheError(
                        f"a worker process died while building partition {futures[future].id} "
                        f"({futures[future].file.relpath}): killed (e.g. by the OS for lack of "
                        "memory) or failed to start (a script calling build_cache with workers "
                        "> 1 needs an `if __name__ == '__main__':` guard); completed partitions "
                        "are kept: rerun the same command to resume (with fewer --workers or a "
                        "smaller --batch-docs if memory is short)"
                    ) from err
                results[data["partition"]] = PartitionResult.from_json(data)
        _drain(queue, progress)
    except BaseException:
        for future in futures:
            future.cancel()
        processes = list((getattr(executor, "_processes", None) or {}).values())
        for process in processes:  # fail fast: do not wait for running partitions
            with contextlib.suppress(Exception):
                process.terminate()
        executor.shutdown(wait=False, cancel_futures=True)
        for process in processes:
            with contextlib.suppress(Exception):
                process.join(5)
        raise
    executor.shutdown(wait=True)
    queue.close()
    return results


def run_local(
    plan: BuildPlan,
    pending: list[Partition],
    encoder: Encoder,
    progress: Progress,
    workers: int,
) -> dict[str, PartitionResult]:
    """The local engine: ``pending`` in this process when a pool would not pay, else the pool.

    In process: one worker, one partition, or a fast-backend text build on at most ``IN_FLIGHT``
    workers, whose threads share one tokenizer (a pool would only add start-ups and loads).
    """
    if workers == 1 or len(pending) <= 1 or (encodes_fast(encoder) and workers <= IN_FLIGHT):
        return run_in_process(plan, pending, encoder, progress)
    return run_pool(plan, pending, encoder, progress, min(workers, len(pending)))


#: Text partitions a one-process build runs at once, in threads: the next one reads and
#: encodes while the one before writes its last batches and publishes, so the cores do not
#: idle between partitions.
IN_FLIGHT = 2


class _LockedProgress(Progress):
    """``progress`` called by one thread at a time."""

    def __init__(self, progress: Progress):
        self.progress = progress
        self.lock = threading.Lock()

    def advance(self, n_bytes: int) -> None:
        with self.lock:
            self.progress.advance(n_bytes)

    def update(self, documents: int, tokens: int) -> None:
        with self.lock:
            self.progress.update(documents, tokens)


def run_in_process(
    plan: BuildPlan, pending: list[Partition], encoder: Encoder, progress: Progress
) -> dict[str, PartitionResult]:
    """Run ``pending`` here: text partitions ``IN_FLIGHT`` at a time, chat ones in turn.

    Each thread gets its own ``TextEncoder.for_partition`` copy; a partition's files depend on
    its input alone, so the order they finish in does not matter.
    """
    if not isinstance(encoder, TextEncoder) or len(pending) <= 1:
        return {p.id: build_partition(plan, p, encoder, progress) for p in pending}
    locked = _LockedProgress(progress)
    started = time.process_time()
    pool = ThreadPoolExecutor(IN_FLIGHT, thread_name_prefix="shardcache-partition")
    try:
        futures = [pool.submit(build_partition, plan, p, encoder.for_partition(), locked)
                   for p in pending]  # fmt: skip
        done, _ = wait(futures, return_when=FIRST_EXCEPTION)
        failed = [f for f in futures if f in done and f.exception() is not None]
        if failed:
            raise failed[0].exception()  # type: ignore[misc]
    finally:  # on an error or Ctrl-C no other partition starts; one running finishes (kept)
        pool.shutdown(wait=False, cancel_futures=True)
    results = {p.id: f.result() for p, f in zip(pending, futures)}
    apportion_process_cpu(list(results.values()), time.process_time() - started)
    return results


def apportion_process_cpu(results: list[PartitionResult], process_cpu: float) -> None:
    """Share a process's CPU among partitions that ran at once (each timed all of it).

    Each result's timings get ``process``, its share by encode time, and ``tokenizer``, the
    part of that beyond its Python-side stages.
    """
    busy = [r.timings.get("encode_busy", 0.0) for r in results]
    total = sum(busy)
    for r, seconds in zip(results, busy):
        share = process_cpu * (seconds / total if total > 0 else 1 / len(results))
        python_side = sum(r.timings.get(s, 0.0) for s in ("read", "parse", "bucket", "write"))
        r.timings["process"] = round(share, 3)
        r.timings["tokenizer"] = round(max(0.0, share - python_side), 3)
