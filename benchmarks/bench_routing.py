"""Time the routing of documents to HF (``code_points.Trusted``): its table and its look-ups.

    python benchmarks/bench_routing.py CORPUS_DIR [--batch-docs 256] [--regex]
                                                  [--build-cpu-s SECONDS]

CORPUS_DIR holds jsonl files with a ``text`` field (e.g. from make_corpus.py). In one run,
interleaved, best of three (CPU time of this process):

* **table**: ``computed_table()`` (every code point's category, then HF's regex classes: what
  every build process paid before the memo) against ``proven_table()`` read from its memo;
* **look-ups**: ``Trusted.outside`` (only the texts with a non-ASCII character) against
  ``Trusted.outside_all`` (every text's code points: the previous method) over the corpus in
  ``--batch-docs`` batches, with the documents each routes (they must agree);
* ``--regex``: a regex class of the untrusted ranges too (slow: for comparison only).

With ``--build-cpu-s`` (the CPU seconds a build of the same corpus took, e.g. ``user + sys``
of ``/usr/bin/time shardcache build ...``) it also prints routing's share of that build, for
``--workers`` processes each paying the table once.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import time

import numpy as np
from results import record_result

from shardcache.builder import code_points
from shardcache.builder.code_points import Trusted


def _best(run, rounds: int = 3) -> tuple[float, object]:
    best, value = float("inf"), None
    for _ in range(rounds):
        start = time.process_time()
        value = run()
        best = min(best, time.process_time() - start)
    return best, value


def main() -> None:
    """Run the comparison."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("corpus")
    parser.add_argument("--batch-docs", type=int, default=256)
    parser.add_argument("--regex", action="store_true", help="also time a regex class (slow)")
    parser.add_argument("--build-cpu-s", type=float, help="CPU seconds of a build of the corpus")
    parser.add_argument("--workers", type=int, default=2, help="build processes (table each)")
    args = parser.parse_args()
    texts = []
    for path in sorted(glob.glob(os.path.join(args.corpus, "*.jsonl"))):
        with open(path, encoding="utf-8") as f:
            texts += [json.loads(line)["text"] for line in f]

    def computed() -> np.ndarray:
        code_points.major_classes.cache_clear()  # (what a new build process pays)
        return code_points.computed_table()

    computed_s, table = _best(computed)
    code_points.proven_table()  # (written to its memo if missing)

    def from_memo() -> np.ndarray:
        code_points.proven_table.cache_clear()
        return code_points.proven_table()

    memo_s, remembered = _best(from_memo)
    assert np.array_equal(table, remembered)
    trusted = Trusted(table)
    batches = [texts[i : i + args.batch_docs] for i in range(0, len(texts), args.batch_docs)]
    methods = {
        "outside (non-ASCII texts, UTF-8)": trusted.outside,
        "outside_all (every code point, before)": trusted.outside_all,
    }
    if args.regex:
        bad = np.flatnonzero(~table)
        cut = np.diff(bad) > 1
        firsts, lasts = bad[np.concatenate(([True], cut))], bad[np.concatenate((cut, [True]))]
        ranges = "".join(
            f"\\U{a:08x}-\\U{b:08x}" for a, b in zip(firsts, lasts) if a >= 0xE000 or b < 0xD800
        )
        pattern = re.compile(f"[{ranges}\\ud800-\\udfff]")
        methods["regex class"] = lambda b: [i for i, t in enumerate(b) if pattern.search(t)]
    chars = sum(map(len, texts)) / 1e6
    ascii_docs = sum(map(str.isascii, texts))
    print(f"{len(texts)} documents ({ascii_docs} ASCII), {chars:.1f} M characters")
    print(f"table: computed {computed_s:.3f} s, from its memo {memo_s:.4f} s")
    figures: dict[str, object] = {
        "documents": len(texts),
        "ascii_documents": ascii_docs,
        "characters_m": round(chars, 1),
        "table_computed_s": round(computed_s, 3),
        "table_memo_s": round(memo_s, 4),
    }
    routed = {}
    for name, outside in methods.items():
        seconds, routes = _best(lambda o=outside: [list(o(b)) for b in batches])
        routed[name] = routes
        count = sum(map(len, routes))  # type: ignore[arg-type]
        print(f"{name}: {seconds:.3f} s, {count} documents routed to HF")
        figures[name] = {"s": round(seconds, 4), "routed": count}
    names = list(methods)
    assert routed[names[0]] == routed[names[1]], "the two methods route other documents"
    if args.build_cpu_s:
        before = args.workers * computed_s + figures[names[1]]["s"]  # type: ignore[index]
        after = args.workers * memo_s + figures[names[0]]["s"]  # type: ignore[index]
        for label, cost in (("before", before), ("after", after)):
            share = cost / args.build_cpu_s
            print(f"routing {label}: {cost:.3f} s = {100 * share:.2f}% of the build's CPU")
            figures[f"share_{label}"] = round(share, 4)
    record_result("bench_routing", vars(args), figures)


if __name__ == "__main__":
    main()
