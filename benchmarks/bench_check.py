"""How long `shardcache check` takes (not part of the tests).

    python benchmarks/bench_check.py --corpus CORPUS --tokenizer TOKENIZER_DIR --shard-size 4096

Builds a cache with many shards (``--shard-size 4096`` gives ~10,000 on a 20k-document
corpus), writes a lock file, then times, best of ``--repeat``:

* ``check CACHE --lock LOCK`` (two JSON files, no tokenizer),
* ``check CACHE RECIPE`` and ``check --lock LOCK RECIPE`` without data (tokenizer load +
  behaviour probe), in-process with imports warm, and as a fresh CLI process (interpreter
  start and the transformers import included);
* data hashing of the inputs, reported as MB/s.
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

from results import record_result


def best_of(repeat: int, fn) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--corpus", required=True)
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--shard-size", default="4096")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()

    from shardcache.builder.key_computation import DataHashing, current_data, current_key
    from shardcache.store.check import cache_key, compare_keys
    from shardcache.store.key import read_lock

    work = tempfile.mkdtemp(prefix="bench-check-")
    try:
        cache = os.path.join(work, "cache")
        lock = os.path.join(work, "shardcache.lock")
        recipe = os.path.join(work, "recipe.toml")
        with open(recipe, "w") as f:
            f.write(f'tokenizer = "{os.path.abspath(args.tokenizer)}"\n')
        cli = [sys.executable, "-m", "shardcache.cli"]
        build = [*cli, "build", recipe, "-i", args.corpus, "-o", cache, "-q"]
        subprocess.run(
            [*build, "--shard-size", args.shard_size], check=True, stdout=subprocess.DEVNULL
        )
        subprocess.run([*cli, "lock", recipe, "-i", args.corpus, "-o", lock], check=True,
                       stdout=subprocess.DEVNULL)  # fmt: skip
        with open(os.path.join(cache, "manifest.json")) as f:
            shards = len(json.load(f)["shards"])
        manifest_mb = os.path.getsize(os.path.join(cache, "manifest.json")) / 1e6
        values = {"tokenizer": args.tokenizer}
        current_key(values, DataHashing())  # warm the imports

        def cache_vs_lock() -> None:
            assert compare_keys(read_lock(lock), cache_key(cache), False).compatible

        def cache_vs_config() -> None:
            assert compare_keys(cache_key(cache), current_key(values, DataHashing()), False)

        def lock_vs_cfg() -> None:
            assert compare_keys(read_lock(lock), current_key(values, DataHashing()), False)

        rows = [
            ("check CACHE --lock LOCK (in-process)", best_of(args.repeat, cache_vs_lock)),
            ("check CACHE RECIPE, no data (in-process)", best_of(args.repeat, cache_vs_config)),
            ("check --lock LOCK RECIPE, no data (in-process)", best_of(args.repeat, lock_vs_cfg)),
        ]  # fmt: skip
        for label, argv in [
            ("check CACHE --lock LOCK (CLI process)", ["check", cache, "--lock", lock]),
            ("check CACHE RECIPE, no data (CLI process)", ["check", cache, recipe]),
            ("check --lock LOCK RECIPE, no data (CLI process)", ["check", "--lock", lock, recipe]),
        ]:  # fmt: skip
            rows.append((label, best_of(args.repeat, lambda a=argv: subprocess.run(
                [*cli, *a], check=True, stdout=subprocess.DEVNULL))))  # fmt: skip
        hashing = DataHashing()
        current_data({"input": args.corpus}, hashing)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"cache: {shards:,} shards, manifest {manifest_mb:.1f} MB; cores {os.cpu_count()}")
    print("| operation | seconds |")
    print("|---|---:|")
    for label, seconds in rows:
        print(f"| {label} | {seconds:.3f} |")
    print(f"| data hashing ({hashing.files} files, {hashing.bytes / 1e6:.1f} MB) | "
          f"{hashing.seconds:.3f} ({hashing.mb_per_second:,.0f} MB/s) |")  # fmt: skip
    record_result("bench_check", {
        "shards": shards, "manifest_mb": manifest_mb, "seconds": dict(rows),
        "hashing": {"files": hashing.files, "bytes": hashing.bytes, "seconds": hashing.seconds},
    }, args)  # fmt: skip


if __name__ == "__main__":
    main()
