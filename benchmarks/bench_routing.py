"""Time the routing of documents to HF (``code_points.Trusted.outside``) against a regex class.

    python benchmarks/bench_routing.py CORPUS_DIR [--batch-docs 256]

CORPUS_DIR holds jsonl files with a ``text`` field (e.g. from make_corpus.py). Prints the best
of three passes of each method over the corpus, in batches, and how many documents each routes.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import time

import numpy as np

from shardcache.builder.code_points import Trusted, proven_table


def main() -> None:
    """Run the comparison."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("corpus")
    parser.add_argument("--batch-docs", type=int, default=256)
    args = parser.parse_args()
    texts = []
    for path in sorted(glob.glob(os.path.join(args.corpus, "*.jsonl"))):
        with open(path, encoding="utf-8") as f:
            texts += [json.loads(line)["text"] for line in f]
    start = time.perf_counter()
    table = proven_table()
    print(f"table: {time.perf_counter() - start:.2f} s")
    trusted = Trusted(table)
    bad = np.flatnonzero(~table)
    cut = np.diff(bad) > 1
    firsts, lasts = bad[np.concatenate(([True], cut))], bad[np.concatenate((cut, [True]))]
    ranges = "".join(
        f"\\U{a:08x}-\\U{b:08x}" for a, b in zip(firsts, lasts) if a >= 0xE000 or b < 0xD800
    )
    pattern = re.compile(f"[{ranges}\\ud800-\\udfff]")
    batches = [texts[i : i + args.batch_docs] for i in range(0, len(texts), args.batch_docs)]
    methods = {
        "numpy table": trusted.outside,
        "regex class": lambda b: [i for i, t in enumerate(b) if pattern.search(t)],
    }
    chars = sum(map(len, texts)) / 1e6
    print(f"{len(texts)} documents, {chars:.1f} M characters")
    for name, outside in methods.items():
        best, routed = float("inf"), 0
        for _ in range(3):
            start = time.perf_counter()
            routed = sum(len(outside(b)) for b in batches)
            best = min(best, time.perf_counter() - start)
        print(f"{name}: {best:.3f} s, {routed} documents routed to HF")


if __name__ == "__main__":
    main()
