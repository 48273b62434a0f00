"""How a build grows with the corpus: wall time and peak memory of ``shardcache build`` per size.

For each ``--corpus`` (a folder or glob of one generated corpus per size, e.g. by
``make_corpus.py --docs N``), runs ``shardcache build`` in a fresh process ``--repeats`` times
and reports the best wall time, the peak RSS of the largest process of the build (the CLI or
one of its workers: ``ru_maxrss`` of the waited-for children, taken in a fresh interpreter per
run so one build's peak never hides another's), and the cache's documents, tokens and bytes.

    for n in 20000 60000 200000 600000; do
        python make_corpus.py /tmp/scale$n --docs $n --files 8 --format jsonl
    done
    python benchmarks/bench_growth.py --tokenizer recipes/quickstart/tokenizer \\
        --corpus '/tmp/scale20000/*.jsonl' --corpus '/tmp/scale60000/*.jsonl' ...

Not collected by pytest.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

from results import record_result

#: Runs one build in a child interpreter and prints its wall time and the peak RSS (KiB) of
#: the processes it waited for: the CLI and, through it, its workers.
CHILD = """
import json, resource, subprocess, sys, time
started = time.perf_counter()
subprocess.run(sys.argv[1:], check=True, capture_output=True)
print(json.dumps({"seconds": time.perf_counter() - started,
                  "peak_rss_kib": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss}))
"""


def build_once(cli: str, corpus: str, tokenizer: str, out: str, workers: int) -> dict:
    """One build in a fresh interpreter: ``seconds`` and ``peak_rss_kib``."""
    shutil.rmtree(out, ignore_errors=True)
    command = [cli, "build", "-i", corpus, "-t", tokenizer, "-o", out, "-q"]
    if workers:
        command += ["--workers", str(workers)]
    done = subprocess.run([sys.executable, "-c", CHILD, *command], check=True,
                          capture_output=True, text=True)  # fmt: skip
    return json.loads(done.stdout)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--corpus", action="append", required=True, help="repeatable, small first")
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--workers", type=int, default=0, help="0: the build's default")
    args = ap.parse_args()
    cli = shutil.which("shardcache") or "shardcache"
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "cache")
        for corpus in args.corpus:
            runs = [build_once(cli, corpus, args.tokenizer, out, args.workers)
                    for _ in range(args.repeats)]  # fmt: skip
            info = json.loads(subprocess.run([cli, "info", out, "--json"], check=True,
                                             capture_output=True, text=True).stdout)  # fmt: skip
            totals = info["totals"]
            row = {
                "corpus": corpus,
                "documents": totals["documents"],
                "tokens": totals["tokens"],
                "input_bytes": totals["input_bytes"],
                "shard_bytes": totals["shard_bytes"],
                "best_s": round(min(r["seconds"] for r in runs), 3),
                "runs_s": [round(r["seconds"], 3) for r in runs],
                "peak_rss_mib": round(max(r["peak_rss_kib"] for r in runs) / 1024, 1),
                "encoder": ", ".join(info["encoder"]["versions"]),
            }
            rows.append(row)
            print(f"{row['documents']:>10,} docs {row['tokens']:>13,} tokens "
                  f"{row['input_bytes'] / 2**20:>8.0f} MiB in: {row['best_s']:7.2f} s, "
                  f"peak RSS {row['peak_rss_mib']:7.1f} MiB ({row['encoder']})")  # fmt: skip
    record_result("bench_growth", {"builds": rows}, args)


if __name__ == "__main__":
    main()
