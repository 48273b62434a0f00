#!/usr/bin/env python3
"""What DataLoader workers cost: batches read in-process against batches received from workers.

    python benchmarks/bench_workers.py CACHE [--workers 0,1,2] [--epochs 2] [--mode concat]
                                             [--start-method fork]

Reads whole epochs of ``ShardDataset`` batches (``max_tokens`` 16 x 2048, shuffled; pack
concat with ``attention="none"``, or pad) through ``DataLoader(ds, batch_size=None,
num_workers=N)`` for each N, and prints per N the wall time a batch and the main process's
CPU time a batch (``time.process_time``: what the training process pays to receive a batch),
best of the epochs after the first (which starts the workers). ``N = 0`` reads in-process
(the compiled kernels when numba is installed). Prints one JSON line per N and a table.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from results import record_result
from torch.utils.data import DataLoader

from shardcache import ShardDataset

MAX_TOKENS = 16 * 2048


def one(path: str, workers: int, epochs: int, mode: str, start_method: str) -> dict:
    options = {"mode": "pack", "packing": "concat", "seq_len": 2048, "attention": "none"}
    ds = ShardDataset(path, MAX_TOKENS, seed=0, **(options if mode == "concat" else {}))
    loader = DataLoader(
        ds,
        batch_size=None,
        num_workers=workers,
        multiprocessing_context=start_method if workers else None,
        persistent_workers=workers > 0,
    )
    best_wall = best_cpu = float("inf")
    batches = 0
    for epoch in range(epochs + 1):
        ds.set_epoch(epoch)
        wall, cpu = time.perf_counter(), time.process_time()
        batches = sum(1 for _ in loader)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        if epoch:  # the first epoch starts the workers
            best_wall, best_cpu = min(best_wall, wall), min(best_cpu, cpu)
    return {
        "workers": workers,
        "mode": mode,
        "batches": batches,
        "wall_ms_per_batch": round(1e3 * best_wall / batches, 3),
        "main_cpu_ms_per_batch": round(1e3 * best_cpu / batches, 3),
        "mtok_s": round(batches * MAX_TOKENS / best_wall / 1e6, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("cache")
    parser.add_argument("--workers", default="0,1,2")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--mode", choices=["concat", "pad"], default="concat")
    parser.add_argument("--start-method", default="fork")
    args = parser.parse_args()
    rows = []
    for workers in (int(w) for w in args.workers.split(",")):
        row = one(args.cache, workers, args.epochs, args.mode, args.start_method)
        print(json.dumps(row), flush=True)
        rows.append(row)
    print("\n| workers | ms a batch | main-process CPU ms a batch | Mtok/s |")
    print("|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['workers']} | {r['wall_ms_per_batch']} | {r['main_cpu_ms_per_batch']} | "
            f"{r['mtok_s']} |"
        )
    record_result("bench_workers", {"rows": rows}, args)


if __name__ == "__main__":
    main()
