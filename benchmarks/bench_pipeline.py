#!/usr/bin/env python3
"""The reader before and after a change, in the same run: throughput and first batch.

    python benchmarks/bench_pipeline.py CACHE --base TREE [--this TREE] [--batches 150]
                                              [--rounds 3]

``--base`` is another checkout of shardcache (e.g. ``git worktree add /tmp/base COMMIT``);
``--this`` (default: this checkout) is the other side. Every measurement runs in a fresh
process with that tree first on ``sys.path``; the two trees alternate (base, this, base,
this, ...) and the best of ``--rounds`` is kept for each side:

* **throughput**, per configuration: real tokens per second over ``--batches`` batches after
  one warm-up batch, by the wall clock and by the process's CPU time (the reader is one
  thread: on a shared machine its CPU time is the steadier figure). Configurations: pad,
  pack best_fit, pack concat (the compiled path where the cache allows it); ``pad+fim`` and
  ``concat+fim``: ``FIM(0.5, ...)`` on the numpy path; ``mix``: the cache as a two-source
  mixture of itself, pad.
* **first batch**: constructing ``ShardDataset`` and ``next(iter(ds))`` (pad), from just after
  the imports.

Prints one JSON line per configuration (``base``, ``this``, ``ratio`` = this / base for
throughput, base / this for the first batch: above 1 is faster) and records them in
``benchmarks/results.jsonl``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from results import record_result

CONFIGS = {
    "pad": {},
    "best_fit": {"mode": "pack", "packing": "best_fit", "seq_len": 1024, "attention": "none"},
    "concat": {"mode": "pack", "packing": "concat", "seq_len": 1024, "attention": "none"},
    "pad+fim": {"fim": True},
    "concat+fim": {
        "mode": "pack", "packing": "concat", "seq_len": 1024, "attention": "none", "fim": True,
    },
    "mix": {"mix": True},
}  # fmt: skip

CHILD = r"""
import json, sys, time, warnings
sys.path.insert(0, sys.argv[1])
from shardcache import FIM, ShardDataset, Source
cache, name, options = sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
batches, max_tokens = int(sys.argv[5]), int(sys.argv[6])
warnings.simplefilter("ignore")
path = cache
if options.pop("mix", False):
    path = [Source(cache, weight=0.6, name="a"), Source(cache, weight=0.4, name="b")]
if options.pop("fim", False):
    options["transform"] = FIM(0.5, 100, 101, 102, spm_rate=0.5)
began = time.perf_counter()
ds = ShardDataset(path, max_tokens=max_tokens, seed=1, **options)
it = iter(ds)
first = next(it)
first_s = time.perf_counter() - began
began, cpu = time.perf_counter(), time.process_time()
count = tokens = 0
for batch in it:
    labels = batch["labels"]
    tokens += int((labels != -100).sum())
    count += 1
    if count == batches:
        break
elapsed, cpu = time.perf_counter() - began, time.process_time() - cpu
print(json.dumps({"first_batch_s": first_s, "tokens_per_s": tokens / elapsed,
                  "cpu_tokens_per_s": tokens / cpu, "batches": count}))
"""


def _run(tree: str, cache: str, name: str, batches: int, max_tokens: int) -> dict[str, float]:
    options = json.dumps(CONFIGS[name])
    args = [sys.executable, "-c", CHILD, tree, cache, name, options, str(batches), str(max_tokens)]
    out = subprocess.run(args, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("cache")
    parser.add_argument("--base", required=True, help="the other checkout (before the change)")
    parser.add_argument("--this", help="the checkout after the change (default: this one)")
    parser.add_argument("--batches", type=int, default=150)
    parser.add_argument("--max-tokens", type=int, default=16384)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    this = args.this or os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    trees = {"base": os.path.abspath(args.base), "this": os.path.abspath(this)}
    best: dict[str, dict[str, dict[str, float]]] = {name: {} for name in CONFIGS}
    for _ in range(args.rounds):
        for name in CONFIGS:
            for side, tree in trees.items():
                got = _run(tree, args.cache, name, args.batches, args.max_tokens)
                kept = best[name].setdefault(side, got)
                kept["tokens_per_s"] = max(kept["tokens_per_s"], got["tokens_per_s"])
                kept["cpu_tokens_per_s"] = max(kept["cpu_tokens_per_s"], got["cpu_tokens_per_s"])
                kept["first_batch_s"] = min(kept["first_batch_s"], got["first_batch_s"])
    figures = {}
    for name, sides in best.items():
        base, ours = sides["base"], sides["this"]
        row = {
            "config": name,
            "base_tokens_per_s": round(base["tokens_per_s"]),
            "this_tokens_per_s": round(ours["tokens_per_s"]),
            "throughput_ratio": round(ours["tokens_per_s"] / base["tokens_per_s"], 3),
            "cpu_throughput_ratio": round(ours["cpu_tokens_per_s"] / base["cpu_tokens_per_s"], 3),
            "base_first_batch_s": round(base["first_batch_s"], 3),
            "this_first_batch_s": round(ours["first_batch_s"], 3),
            "first_batch_ratio": round(base["first_batch_s"] / ours["first_batch_s"], 3),
        }
        figures[name] = row
        print(json.dumps(row), flush=True)
    record_result("bench_pipeline", vars(args), figures)


if __name__ == "__main__":
    main()
