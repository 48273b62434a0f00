#!/usr/bin/env python3
"""Mixture benchmark: plan time against a single cache, first batch of many sources, read cost.

    python benchmarks/bench_mixture.py [--plan-sequences 10000000] [--sources 3]
                                       [--cache CACHE] [--first-batch-sources 50]
                                       [--batches 300] [--only plan,first_batch,read]

Measures, single process, no DataLoader:

* **plan time** (synthetic, no files): a mixture of ``--sources`` sources of
  ``--plan-sequences`` lognormal lengths each (median 400, clipped to 4096, power-of-two
  buckets; equal weights, so the smallest source is used whole and the others, a little
  larger, through their rotating windows: ``chosen`` is close to all sequences) against
  ``plan_epoch`` over one cache of all those sequences, per mode, best of 3; the issue's
  target: ``ratio`` <= 2.
* **first batch** (``--cache``): a fresh process constructs ``ShardDataset`` over
  ``--first-batch-sources`` sources (the same cache under distinct names) and takes
  ``next(iter(ds))``; target < 2 s.
* **read cost per batch** (``--cache``): ``--batches`` batches of a single cache against a
  mixture of two sources (the cache twice, equal weights), per mode: three rounds, each
  timing every reader in turn for 3 runs; each reader's best run counts. Both read with the
  compiled kernels when numba is installed (``compiled``); the single cache is also timed on
  the numpy path (``kernels`` off) for scale. Target: ``ratio_vs_single`` <= 1.10. The
  reading thread's CPU time is reported too (``*_cpu_s``, ``cpu_ratio_vs_single``): on a
  machine other processes share, it moves less than wall-clock time. A mixture of the cache
  alone reads the very batches of the single cache (one source used once: the same plan), so
  ``one_source_ratio_vs_single`` is the mixture's own cost with the batches held equal.

``--only`` runs some of the three (comma-separated names).

Prints one JSON line per measurement and a markdown table at the end, and appends the run to
``benchmarks/results.jsonl`` (``results.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np
from results import record_result

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from shardcache import PlanOptions, plan_epoch
from shardcache.read.dataset import ShardDataset
from shardcache.read.selection.mixture import Mixture, MixtureIndex, Source
from shardcache.read.selection.mixture_table import solve_mixture

REPEATS = 3
MODES = {
    "pad": {},
    "pack-best_fit": {"mode": "pack", "seq_len": 4096, "packing": "best_fit"},
    "pack-concat": {"mode": "pack", "seq_len": 4096, "packing": "concat"},
}


def _best(run) -> float:
    best = float("inf")
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - t0)
    return best


def bench_plan(n: int, num_sources: int, rows: list[dict]) -> None:
    rng = np.random.default_rng(0)
    parts = [
        np.clip(rng.lognormal(np.log(400), 1.2, n), 1, 4096).astype(np.uint32)
        for _ in range(num_sources)
    ]
    lengths = np.concatenate(parts)
    buckets = np.searchsorted([64, 128, 256, 512, 1024, 2048, 4096], lengths).astype(np.int32)
    sources = tuple(Source(f"s{i}") for i in range(num_sources))
    table = solve_mixture(sources, [n] * num_sources, [int(p.sum(dtype=np.int64)) for p in parts])
    digests = tuple(f"digest-{i}" for i in range(num_sources))
    mixture = Mixture(sources, table, MixtureIndex.of([n] * num_sources), digests)
    for name, extra in MODES.items():
        opts = PlanOptions(max_tokens=16384, **extra)
        single = _best(lambda opts=opts: plan_epoch(lengths, buckets, opts, seed=1, epoch=0))
        units = mixture.units(lengths)
        mixed = _best(
            lambda opts=opts, units=units: mixture.plan(lengths, buckets, opts, 1, 0, units)
        )
        chosen = len(mixture.documents(units, 1, 0))
        row = {"what": "plan", "mode": name, "sources": num_sources, "sequences": n,
               "chosen": chosen, "single_s": single, "mixture_s": mixed,
               "ratio": mixed / single}  # fmt: skip
        print(json.dumps(row), flush=True)
        rows.append(row)


FIRST_BATCH = """
import sys, time
t0 = time.perf_counter()
sys.path.insert(0, {root!r})
from shardcache.read.dataset import ShardDataset
from shardcache.read.selection.mixture import Source
t1 = time.perf_counter()
sources = [Source({path!r}, name=f"s{{i}}") for i in range({count})]
ds = ShardDataset(sources, 16384, seed=0, rank=0, world_size=1{extra})
batch = next(iter(ds))
t2 = time.perf_counter()
print(t2 - t1, t1 - t0)
"""


def reader(extra: dict) -> dict:
    """The ShardDataset keywords of a mode (pack needs attention=)."""
    return {**extra, "attention": "none"} if extra.get("mode") == "pack" else dict(extra)


def bench_first_batch(path: str, count: int, rows: list[dict]) -> None:
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    for name, extra in MODES.items():
        kw = "".join(f", {k}={v!r}" for k, v in reader(extra).items())
        code = FIRST_BATCH.format(root=root, path=path, count=count, extra=kw)
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        if out.returncode:
            raise SystemExit(out.stderr)
        first, imports = map(float, out.stdout.split())
        row = {"what": "first_batch", "mode": name, "sources": count, "seconds": first,
               "import_s": imports}  # fmt: skip
        print(json.dumps(row), flush=True)
        rows.append(row)


def _per_batch(ds: ShardDataset, batches: int) -> tuple[float, float]:
    """Seconds per batch over ``batches`` batches after one warm-up (cycling epochs), best of
    3: wall-clock and the reading thread's CPU time."""

    def run() -> None:
        taken, epoch = 0, 0
        while taken < batches:
            ds.set_epoch(epoch)
            for _ in ds:
                taken += 1
                if taken == batches:
                    return
            epoch += 1

    ds.set_epoch(0)
    next(iter(ds))
    wall = cpu = float("inf")
    for _ in range(REPEATS):
        t0, c0 = time.perf_counter(), time.thread_time()
        run()
        wall = min(wall, time.perf_counter() - t0)
        cpu = min(cpu, time.thread_time() - c0)
    return wall / batches, cpu / batches


def bench_read(path: str, batches: int, rows: list[dict]) -> None:
    for name, extra in MODES.items():
        options = {"seed": 0, "rank": 0, "world_size": 1, **reader(extra)}
        single = ShardDataset(path, 16384, **options)
        numpy_single = ShardDataset(path, 16384, **options)
        numpy_single.kernels = False
        mixed = ShardDataset([Source(path, name="a"), Source(path, name="b")], 16384, **options)
        one = ShardDataset([Source(path, name="a")], 16384, **options)
        for ds in (mixed, one):
            next(iter(ds))
        compiled = single.reads_compiled and mixed.reads_compiled and one.reads_compiled
        readers = {"kernels": single, "numpy": numpy_single, "mixture": mixed, "one": one}
        times: dict[str, list[tuple[float, float]]] = {k: [] for k in readers}
        for _ in range(REPEATS):  # interleaved
            for key, ds in readers.items():
                times[key].append(_per_batch(ds, batches))
        best = {k: min(w for w, _ in v) for k, v in times.items()}
        cpu = {k: min(c for _, c in v) for k, v in times.items()}
        row = {"what": "read", "mode": name, "batches": batches,
               "single_kernels_s": best["kernels"], "single_numpy_s": best["numpy"],
               "mixture_s": best["mixture"], "compiled": compiled,
               "ratio_vs_single": best["mixture"] / best["kernels"],
               "ratio_vs_numpy": best["mixture"] / best["numpy"],
               "single_kernels_cpu_s": cpu["kernels"], "mixture_cpu_s": cpu["mixture"],
               "cpu_ratio_vs_single": cpu["mixture"] / cpu["kernels"],
               "one_source_s": best["one"],
               "one_source_ratio_vs_single": best["one"] / best["kernels"]}  # fmt: skip
        print(json.dumps(row), flush=True)
        rows.append(row)


def table(rows: list[dict]) -> str:
    lines = ["| what | mode | figures |", "|---|---|---|"]
    for row in rows:
        figures = ", ".join(
            f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
            for k, v in row.items()
            if k not in ("what", "mode")
        )
        lines.append(f"| {row['what']} | {row['mode']} | {figures} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--plan-sequences", type=int, default=10_000_000)
    parser.add_argument("--sources", type=int, default=3)
    parser.add_argument("--cache", help="a cache for the first-batch and read measurements")
    parser.add_argument("--first-batch-sources", type=int, default=50)
    parser.add_argument("--batches", type=int, default=300)
    parser.add_argument("--only", default="plan,first_batch,read", help="what to measure")
    args = parser.parse_args()
    only = set(args.only.split(","))
    if only - {"plan", "first_batch", "read"}:
        parser.error(f"--only: got {args.only!r}, expected names of plan, first_batch, read")
    if only - {"plan"} and not args.cache:
        parser.error("first_batch and read need --cache")
    rows: list[dict] = []
    if "plan" in only:
        bench_plan(args.plan_sequences, args.sources, rows)
    if "first_batch" in only:
        bench_first_batch(args.cache, args.first_batch_sources, rows)
    if "read" in only:
        bench_read(args.cache, args.batches, rows)
    print(table(rows))
    record_result("bench_mixture", {"rows": rows}, args)


if __name__ == "__main__":
    main()
