#!/usr/bin/env python3
"""A mixture's cost to one rank at many ranks, against one cache of the same documents.

    PYTHONPATH=. python benchmarks/bench_mixture_rank.py \
        --set 1M=/tmp/mx/one1m:/tmp/mx/src1m --set 4M=/tmp/mx/one4m:/tmp/mx/src4m \
        [--world 1024] [--rank 0] [--max-tokens 16384] [--repeats 3] [--workers 0]

Each ``--set NAME=ONE:SOURCES`` names one cache (``ONE``) and a folder of caches holding the
same documents between them (``SOURCES/*``, e.g. the 20 files of one corpus built one each).
For each set and each side (``one``: ``ShardDataset(ONE)``; ``mixture``: the sources at equal
weight, each used once), a fresh process as rank ``--rank`` of ``--world`` (streams = world,
the default) constructs the dataset and takes its first batch: ``first_batch_s`` (construction
to the first batch), ``traced_peak_mib`` (tracemalloc's peak over the same span: numpy's and
Python's allocations, not the pages of memory-mapped indexes) and ``rss_mib`` (``ru_maxrss``,
which counts those pages). Sides run interleaved, each the best of ``--repeats`` fresh
processes (one traced run, then timed runs without tracemalloc). ``--workers N`` takes the
first batch through a DataLoader of N workers instead (each worker plans what it reads).
The processes share ``--cache-dir`` as ``SHARDCACHE_CACHE_DIR``, so after the first a rank
finds every stream's batch counts stored (as a second rank of a machine, or a DataLoader
worker, does); ``--cold`` gives each its own empty one (it counts every stream itself).

Make the sets from one generated corpus of short documents, e.g.::

    python ../shared/bench/make_corpus.py /tmp/mx/corpus4m --docs 4000000 --files 20 \
        --format jsonl --median-chars 120 --sigma 0.6 --max-chars 2000
    shardcache build -i /tmp/mx/corpus4m --exclude expected.json -t recipes/quickstart/tokenizer \
        -o /tmp/mx/one4m --max-length 512 --truncation split --shard-size 4MiB
    # and each part-000NN.jsonl alone into /tmp/mx/src4m/sNN

Prints a JSON line per measurement and a markdown table (``ratio``: mixture over one cache),
and appends the run to ``benchmarks/results.jsonl`` (``results.py``). Not collected by pytest.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def child(args: argparse.Namespace) -> dict:
    """One measurement in this (fresh) process."""
    import resource
    import tracemalloc

    import torch  # noqa: F401  (imported before the timing, as a training script has it)

    from shardcache import ShardDataset, Source

    if args.side == "one":
        path: object = args.one
    else:
        names = sorted(os.listdir(args.sources))
        path = [Source(os.path.join(args.sources, n), name=n) for n in names]
    if args.traced:
        tracemalloc.start()
    started = time.perf_counter()
    ds = ShardDataset(
        path, max_tokens=args.max_tokens, rank=args.rank, world_size=args.world, seed=0
    )
    if args.workers:
        from torch.utils.data import DataLoader

        batch = next(iter(DataLoader(ds, batch_size=None, num_workers=args.workers)))
    else:
        batch = next(iter(ds))
    elapsed = time.perf_counter() - started
    peak = tracemalloc.get_traced_memory()[1] / 2**20 if args.traced else None
    if args.traced:
        tracemalloc.stop()
    return {
        "first_batch_s": elapsed,
        "traced_peak_mib": peak,
        "rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "tokens": int(batch["input_ids"].numel()),
    }


def run_child(args: argparse.Namespace, side: str, one: str, sources: str, traced: bool) -> dict:
    cmd = [
        sys.executable, __file__, "--child", side, "--one", one, "--sources", sources,
        "--world", str(args.world), "--rank", str(args.rank),
        "--max-tokens", str(args.max_tokens), "--workers", str(args.workers),
    ]  # fmt: skip
    if traced:
        cmd.append("--traced")
    cache_dir = args.cache_dir
    if args.cold:  # nothing of an earlier run on the machine: every stream counted here
        cache_dir = tempfile.mkdtemp(prefix="cold-", dir=args.cache_dir)
    env = dict(os.environ, SHARDCACHE_CACHE_DIR=cache_dir)
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if args.cold:
        shutil.rmtree(cache_dir, ignore_errors=True)
    if out.returncode:
        raise SystemExit(f"{side} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--set", action="append", default=[], help="NAME=ONE:SOURCES")
    parser.add_argument("--world", type=int, default=1024)
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--max-tokens", type=int, default=16384)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--cache-dir", default="/tmp/bench-mixture-rank-cache")
    parser.add_argument(
        "--cold",
        action="store_true",
        help="a fresh SHARDCACHE_CACHE_DIR per process (no stored counts)",
    )
    parser.add_argument("--child", choices=("one", "mixture"), help=argparse.SUPPRESS)
    parser.add_argument("--one", help=argparse.SUPPRESS)
    parser.add_argument("--sources", help=argparse.SUPPRESS)
    parser.add_argument("--traced", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        args.side = args.child
        print(json.dumps(child(args)))
        return
    if not args.set:
        parser.error("give at least one --set NAME=ONE:SOURCES")
    rows = []
    for spec in args.set:
        name, _, paths = spec.partition("=")
        one, _, sources = paths.partition(":")
        figures: dict[str, dict] = {}
        for side in ("one", "mixture"):
            figures[side] = run_child(args, side, one, sources, traced=True)
        best = {side: float("inf") for side in figures}
        for _ in range(args.repeats):
            for side in figures:  # interleaved
                got = run_child(args, side, one, sources, traced=False)
                best[side] = min(best[side], got["first_batch_s"])
        for side in figures:
            row = {
                "set": name, "side": side, "world": args.world, "rank": args.rank,
                "workers": args.workers, "first_batch_s": round(best[side], 3),
                "traced_peak_mib": round(figures[side]["traced_peak_mib"], 1),
                "rss_mib": round(figures[side]["rss_mib"], 1),
            }  # fmt: skip
            print(json.dumps(row), flush=True)
            rows.append(row)
    print("\n| set | side | first batch (s) | traced peak (MiB) | RSS (MiB) |")
    print("|---|---|---|---|---|")
    for row in rows:
        print(
            f"| {row['set']} | {row['side']} | {row['first_batch_s']} | "
            f"{row['traced_peak_mib']} | {row['rss_mib']} |"
        )
    from results import record_result

    hidden = ("child", "one", "sources", "traced")
    options = {k: v for k, v in vars(args).items() if k not in hidden}
    record_result("bench_mixture_rank", {"rows": rows}, options)
    sets = sorted({r["set"] for r in rows}, key=[r["set"] for r in rows].index)
    for name in sets:
        one = next(r for r in rows if r["set"] == name and r["side"] == "one")
        mix = next(r for r in rows if r["set"] == name and r["side"] == "mixture")
        ratio = mix["first_batch_s"] / one["first_batch_s"]
        print(
            f"{name}: mixture / one cache: first batch {ratio:.2f}x, "
            f"traced peak {mix['traced_peak_mib'] / max(one['traced_peak_mib'], 1e-9):.2f}x "
            f"(+{mix['traced_peak_mib'] - one['traced_peak_mib']:.1f} MiB)"
        )


if __name__ == "__main__":
    main()
