#!/usr/bin/env python3
"""What storing a pair's prompt on both sides costs, against storing it once (not a test).

    python benchmarks/bench_pair_storage.py CACHE [--rows-per-batch 1024]

A preference cache stores pair ``k`` as two whole sequences, rows ``2k`` (chosen) and ``2k + 1``
(rejected), each with the prompt. The alternative is the prompt once: the rejected row without
the tokens before its first trainable one. This script re-encodes the cache's token ids both
ways as the shards are written (Arrow IPC, zstd, record batches of ``--rows-per-batch`` rows,
the ids in the cache's dtype) and reports raw tokens and compressed bytes of each. Sides are
adjacent rows, so zstd finds most of the repeated prompt: the compressed cost of storing it
twice is far below its token share.
"""

from __future__ import annotations

import argparse
import io
import sys

import numpy as np
import pyarrow as pa
from results import record_result

from shardcache import open_cache


def compressed_bytes(rows: list[np.ndarray], dtype: np.dtype, rows_per_batch: int) -> int:
    """Bytes of ``rows`` as one Arrow IPC file with zstd, ``rows_per_batch`` rows a batch."""
    arrow_type = pa.from_numpy_dtype(dtype)
    table = pa.table({"ids": pa.array([r.astype(dtype) for r in rows], pa.list_(arrow_type))})
    sink = io.BytesIO()
    options = pa.ipc.IpcWriteOptions(compression="zstd")
    with pa.ipc.new_file(sink, table.schema, options=options) as writer:
        for batch in table.to_batches(max_chunksize=rows_per_batch):
            writer.write_batch(batch)
    return len(sink.getvalue())


def main() -> None:
    """Measure one cache and record the figures."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("cache")
    parser.add_argument("--rows-per-batch", type=int, default=1024)
    args = parser.parse_args()
    cache = open_cache(args.cache)
    if not cache.is_preference:
        sys.exit(f"{args.cache}: not a preference cache (built with --preference)")
    ids = list(range(cache.num_sequences))
    rows = [cache.read(i) for i in ids]
    masks = cache.read_masks(ids)
    prompt = np.array([int(np.argmax(m > 0)) for m in masks])  # tokens before the first trained
    shared = [r if i % 2 == 0 else r[prompt[i] :] for i, r in enumerate(rows)]
    both = compressed_bytes(rows, cache.dtype, args.rows_per_batch)
    once = compressed_bytes(shared, cache.dtype, args.rows_per_batch)
    tokens = int(sum(len(r) for r in rows))
    figures = {
        "pairs": len(rows) // 2,
        "tokens_prompt_on_both_sides": tokens,
        "tokens_prompt_once": int(sum(len(r) for r in shared)),
        "prompt_share_of_tokens": round(float(prompt.sum()) / tokens, 4),
        "zstd_bytes_prompt_on_both_sides": both,
        "zstd_bytes_prompt_once": once,
        "bytes_ratio": round(both / once, 4),
    }
    for name, value in figures.items():
        print(f"{name}: {value}")
    record_result("bench_pair_storage", figures, vars(args))


if __name__ == "__main__":
    main()
