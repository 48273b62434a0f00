#!/usr/bin/env python3
"""Cost of the pack-mode attention keys (shardcache.read.collate.attention) per batch, on the host.

    python benchmarks/bench_attention.py                      # R=2 x L=4096, ~8 docs per row
    python benchmarks/bench_attention.py --rows 1 --seq-len 8192 --docs 16
    python benchmarks/bench_attention.py --rows 2 --seq-len 64 --repeats 2   # smoke run

Prints, per mode, the median build time over ``--repeats`` and the bytes the keys add to a
batch: ``attention="mask"`` is R x 1 x L x L float32 (R * L * L * 4 bytes), built in the
DataLoader worker and copied to the device with the batch; ``"varlen"`` is two int32 arrays of
(segments + 1). The token ids (int64, R x L) are printed for scale.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
from results import record_result

from shardcache.read.collate.attention import block_causal_mask, varlen_keys


def positions(rows: int, seq_len: int, docs: int, seed: int) -> np.ndarray:
    """Position ids of ``rows`` packed rows, each ``docs`` random documents then padding."""
    rng = np.random.default_rng(seed)
    out = np.empty((rows, seq_len), dtype=np.int64)
    for r in range(rows):
        cuts = np.sort(rng.choice(np.arange(1, seq_len), size=docs, replace=False))
        starts = np.concatenate([[0], cuts])
        lengths = np.diff(np.concatenate([starts, [seq_len]]))
        out[r] = np.arange(seq_len) - np.repeat(starts, lengths)
    return out


def timed(fn, repeats: int) -> tuple[float, object]:
    times, result = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--docs", type=int, default=8, help="documents per row")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    pos = positions(args.rows, args.seq_len, min(args.docs, args.seq_len - 1), seed=0)
    ids_bytes = pos.size * 8
    print(f"R={args.rows} L={args.seq_len} docs/row={args.docs}: token ids {ids_bytes:,} bytes")
    mask_s, mask = timed(lambda: block_causal_mask(pos), args.repeats)
    seconds = mask_s
    assert isinstance(mask, np.ndarray)
    print(
        f"mask:   {seconds * 1e3:8.1f} ms  {mask.nbytes:>14,} bytes ({mask.nbytes / 2**20:.0f} MiB)"
    )
    seconds, keys = timed(lambda: varlen_keys(pos), args.repeats)
    assert isinstance(keys, dict)
    extra = keys["cu_seq_lens_q"].nbytes + keys["cu_seq_lens_k"].nbytes
    print(f"varlen: {seconds * 1e3:8.3f} ms  {extra:>14,} bytes")
    record_result("bench_attention", {
        "ids_bytes": ids_bytes, "mask_seconds": mask_s, "mask_bytes": int(mask.nbytes),
        "varlen_seconds": seconds, "varlen_bytes": int(extra),
    }, args)  # fmt: skip


if __name__ == "__main__":
    main()
