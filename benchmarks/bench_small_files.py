"""Milliseconds per tiny input file: small files grouped into partitions, or one each.

    python benchmarks/bench_small_files.py --tokenizer TOKENIZER_DIR [--files 2000] \
        [--workers 1] [--repeat 3]

Writes ``--files`` one-record ``.jsonl`` files (about 100 bytes each) and builds them with
``shardcache build`` in a fresh process per build, interleaved for ``--repeat`` rounds
(best of each):

* ``grouped``: the default plan, consecutive small files gathered into partitions;
* ``one per file``: ``--partition-size 1KiB``, under which only files below 64 bytes are
  grouped, so every file is a partition of its own (the plan before grouping).

Figures: ``ms_per_file`` = the build's own seconds (from the start of ``build_cache`` to the
manifest, tokenizer load included) / files; ``wall_ms_per_file`` adds interpreter start and
imports; ``partitions`` of each plan.
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

PLANS = {"grouped": [], "one per file": ["--partition-size", "1KiB"]}


def write_files(folder: str, n: int) -> None:
    """``n`` one-record files of about 100 bytes (over 64: never grouped at 1 KiB)."""
    os.makedirs(folder)
    for k in range(n):
        text = f"document {k}: the quick brown fox jumps over the lazy dog, again and again"
        with open(os.path.join(folder, f"f{k:07d}.jsonl"), "w", encoding="utf-8") as f:
            f.write(json.dumps({"text": text}) + "\n")


def build(corpus: str, tokenizer: str, out: str, workers: int, extra: list[str]) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, "-m", "shardcache.cli", "build", "-i", corpus, "-t", tokenizer,
           "-o", out, "-w", str(workers), "-q", "--json", *extra]  # fmt: skip
    started = time.perf_counter()
    report = json.loads(subprocess.run(cmd, check=True, capture_output=True).stdout)
    report["wall"] = time.perf_counter() - started
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokenizer", required=True)
    parser.add_argument("--files", type=int, default=2000)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    best: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        corpus = os.path.join(tmp, "corpus")
        write_files(corpus, args.files)
        for _ in range(args.repeat):
            for name, extra in PLANS.items():
                report = build(corpus, args.tokenizer, os.path.join(tmp, "out"), args.workers,
                               extra)  # fmt: skip
                if name not in best or report["seconds"] < best[name]["seconds"]:
                    best[name] = report
    figures = {}
    for name, report in best.items():
        row = {
            "partitions": report["partitions"],
            "ms_per_file": 1000 * report["seconds"] / args.files,
            "wall_ms_per_file": 1000 * report["wall"] / args.files,
        }
        figures[name] = row
        print(f"{name:>13}: {row['partitions']:>6,} partitions, {row['ms_per_file']:7.2f} ms "
              f"per file ({row['wall_ms_per_file']:.2f} ms with start-up), "
              f"{args.files:,} files, {args.workers} worker(s)")  # fmt: skip
    record_result("bench_small_files", figures, args)


if __name__ == "__main__":
    main()
