"""The cold pass: one fresh process, one whole unshuffled pass, as the side-by-side harness
times it (``ShardDataset`` made and iterated in-process, each batch's ids summed in numpy and
its padding slots counted from ``meta["num_tokens"]``), interleaved over caches or checkouts.

    python benchmarks/bench_cold.py CACHE[@TREE] [CACHE[@TREE] ...] [--mode concat|pad]
        [--runs 12] [--env-ab NAME]

``@TREE`` runs that cache with another checkout of shardcache (its folder on PYTHONPATH), so
the commit before a change can read the cache it built. ``--env-ab NAME`` runs every spec
with the environment variable ``NAME=0`` and ``NAME=1`` (an on/off switch, e.g.
``SHARDCACHE_SHARD_CHECKSUMS``). Each run is a new interpreter (imports untimed); the report
is min and median seconds per spec.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys

from results import record_result

CHILD = r"""
import sys, time
import numpy as np
from shardcache import ShardDataset
path, mode = sys.argv[1], sys.argv[2]
started = time.perf_counter()
if mode == "pad":
    ds = ShardDataset(path, max_tokens=16 * 2048, shuffle=False)
else:
    ds = ShardDataset(path, max_tokens=16 * 2048, shuffle=False, mode="pack", packing="concat",
                      seq_len=2048, attention="none")
total = 0
for batch in ds:
    ids, meta = batch["input_ids"].numpy(), batch["meta"]
    real = meta.get("num_tokens")
    if real is None:  # a checkout from before meta["num_tokens"]
        if mode == "pad":
            real = int(batch["attention_mask"].sum())
        else:
            lengths = np.diff(meta["cu_seqlens"].numpy())
            real = int(lengths[meta["sample_ids"].numpy() >= 0].sum())
    total += int(ids.sum(dtype=np.uint64)) - ds.pad_id * (ids.size - real)
print(time.perf_counter() - started, total)
"""


def run_once(cache: str, tree: str | None, mode: str, env: dict[str, str]) -> tuple[float, int]:
    child_env = {**os.environ, **env}
    if tree is not None:
        child_env["PYTHONPATH"] = tree
    out = subprocess.run([sys.executable, "-c", CHILD, cache, mode], env=child_env,
                         capture_output=True, text=True, check=True)  # fmt: skip
    seconds, total = out.stdout.split()
    return float(seconds), int(total)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("specs", nargs="+", help="CACHE or CACHE@TREE")
    parser.add_argument("--mode", choices=("concat", "pad"), default="concat")
    parser.add_argument("--runs", type=int, default=12)
    parser.add_argument("--env-ab", metavar="NAME", help="run each spec with NAME=0 and =1")
    args = parser.parse_args()
    variants = []
    for spec in args.specs:
        cache, _, tree = spec.partition("@")
        envs = [{args.env_ab: v} for v in ("0", "1")] if args.env_ab else [{}]
        for env in envs:
            label = spec + "".join(f" {k}={v}" for k, v in env.items())
            variants.append((label, cache, tree or None, env))
    times: dict[str, list[float]] = {label: [] for label, *_ in variants}
    sums: dict[str, set[int]] = {label: set() for label, *_ in variants}
    for _ in range(args.runs):  # interleaved: every variant once per round
        for label, cache, tree, env in variants:
            seconds, total = run_once(cache, tree, args.mode, env)
            times[label].append(seconds)
            sums[label].add(total)
    figures = {}
    for label, values in times.items():
        same = "one checksum" if len(sums[label]) == 1 else f"CHECKSUMS DIFFER: {sums[label]}"
        median = statistics.median(values)
        print(f"{label}: {args.mode} min {min(values):.4f} s, median {median:.4f} s over "
              f"{len(values)} fresh processes ({same})")  # fmt: skip
        figures[label] = {"min_seconds": min(values), "median_seconds": median,
                          "runs": len(values), "one_checksum": len(sums[label]) == 1}  # fmt: skip
    record_result("bench_cold", figures, args)


if __name__ == "__main__":
    main()
