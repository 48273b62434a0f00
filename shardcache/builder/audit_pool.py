"""The reference encoding of ``verify --tokens``, on one core or all of them.

Batches are encoded with the HF reference here or in a ``spawn`` pool (fork after the
tokenizer's Rayon pool started would deadlock); each worker builds its own encoder from the
tokenizer's files (never a memo). Results come back in submission order, so an audit's outcome
never depends on the number of workers.
"""

from __future__ import annotations

import collections
import itertools
import multiprocessing
import os
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any, TypeVar

from shardcache.builder.encoders import Encoder, make_encoder
from shardcache.builder.pool import check_main_importable
from shardcache.builder.tokenize import Encoded, TruncationStats
from shardcache.config import ChatOptions, TokenizeOptions, default_workers
from shardcache.errors import ShardcacheError

#: Batches queued per worker: one encoding while the next waits, as the parent reads ahead.
AHEAD_PER_WORKER = 2

Key = TypeVar("Key")
_WORKER: dict[str, Encoder] = {}


def encode_batch(encoder: Encoder, texts: list[Any]) -> Encoded:
    """Encode texts (or conversations) as the build stores them."""
    return encoder.finish(encoder.encode_texts(texts), TruncationStats())


def _init(tokenize: TokenizeOptions, chat: ChatOptions | None, rayon_threads: int) -> None:
    # before the tokenizer's Rayon pool starts (on the first encode_batch)
    os.environ["RAYON_NUM_THREADS"] = str(rayon_threads)
    _WORKER["encoder"] = make_encoder(tokenize, chat, audit=True)


def _run(texts: list[Any]) -> Encoded:
    return encode_batch(_WORKER["encoder"], texts)


def encode_in_order(
    encoder: Encoder,
    jobs: Iterable[tuple[Key, list[Any]]],
    workers: int,
    tokenize: TokenizeOptions,
    chat: ChatOptions | None,
) -> Iterator[tuple[Key, Encoded]]:
    """Encode each job's texts; yield ``(key, encoded)`` in the order of ``jobs``.

    ``encoder`` (this process's) serves one worker or a single batch; else each spawned worker
    builds its own from ``tokenize``/``chat``. ``jobs`` is read lazily as workers free up.
    Raises ``ShardcacheError`` if ``__main__`` is not importable or a worker died.
    """
    jobs = iter(jobs)
    head = list(itertools.islice(jobs, 2))
    if workers <= 1 or len(head) < 2:  # one batch: not worth starting processes
        for key, texts in itertools.chain(head, jobs):
            yield key, encode_batch(encoder, texts)
        return
    jobs = itertools.chain(head, jobs)
    check_main_importable(workers)
    threads = max(1, default_workers() // workers)
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(
        workers, mp_context=context, initializer=_init, initargs=(tokenize, chat, threads)
    ) as pool:
        pending: collections.deque[tuple[Key, Future[Encoded]]] = collections.deque()
        try:
            for key, texts in jobs:
                pending.append((key, pool.submit(_run, texts)))
                if len(pending) >= workers * AHEAD_PER_WORKER:
                    done, future = pending.popleft()
                    yield done, future.result()
            while pending:
                done, future = pending.popleft()
                yield done, future.result()
        except BrokenProcessPool as err:
            raise ShardcacheError(
                f"verify --tokens: an encoding worker of {workers} died (e.g. killed by the "
                "OS for lack of memory); rerun with fewer --workers"
            ) from err
        finally:
            for _, future in pending:
                future.cancel()
