"""What the README's set-up installs, measured: a build in one venv against a build in another.

Each venv is made by the README's first command (``pip install -c constraints-cpu.txt -e .``
in a checkout of the revision measured); the script runs ``shardcache build`` of one corpus
with each venv's CLI, interleaved, ``--repeats`` times per tokenizer, and reports the best wall
time per side and the encoder each build used (``shardcache info``). Used for issue 58: the
venv of the revision before the compiled encoders became dependencies against the venv after.

    python3 -m venv /tmp/v-before && git archive BEFORE | tar -x -C /tmp/sc-before
    (cd /tmp/sc-before && /tmp/v-before/bin/pip install -c constraints-cpu.txt -e .)
    ... the same for /tmp/v-after from this checkout ...
    python /work/shared/bench/make_corpus.py /tmp/c58 --docs 20000 --files 4 --format jsonl
    python benchmarks/bench_setup.py --venv before=/tmp/v-before --venv after=/tmp/v-after \\
        --corpus '/tmp/c58/*.jsonl' --tokenizer recipes/quickstart/tokenizer

Not collected by pytest.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import tempfile
import time

from results import record_result


def build(venv: str, corpus: str, tokenizer: str, out: str) -> tuple[float, str]:
    """Wall seconds of one ``shardcache build`` with ``venv``'s CLI, and the encoder it used."""
    cli = os.path.join(venv, "bin", "shardcache")
    shutil.rmtree(out, ignore_errors=True)
    started = time.perf_counter()
    subprocess.run([cli, "build", "-i", corpus, "-t", tokenizer, "-o", out, "-q"], check=True,
                   capture_output=True)  # fmt: skip
    elapsed = time.perf_counter() - started
    info = subprocess.run([cli, "info", out, "--json"], check=True, capture_output=True,
                          text=True)  # fmt: skip
    versions = json.loads(info.stdout)["encoder"]["versions"]
    return elapsed, ", ".join(versions)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--venv", action="append", required=True, help="NAME=PATH, repeatable")
    ap.add_argument("--corpus", required=True, help="input files (a glob is fine)")
    ap.add_argument("--tokenizer", action="append", required=True, help="repeatable")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    venvs = dict(v.split("=", 1) for v in args.venv)
    figures: dict[str, dict[str, dict[str, object]]] = {}  # tokenizer -> venv -> figures
    with tempfile.TemporaryDirectory() as tmp:
        for tokenizer in args.tokenizer:
            runs: dict[str, list[float]] = {name: [] for name in venvs}
            encoders: dict[str, str] = {}
            for _ in range(args.repeats):
                for name, venv in venvs.items():
                    seconds, encoders[name] = build(venv, args.corpus, tokenizer,
                                                    os.path.join(tmp, name))  # fmt: skip
                    runs[name].append(seconds)
            label = os.path.basename(os.path.normpath(tokenizer))
            figures[label] = {name: {"best_s": round(min(times), 3),
                                     "runs_s": [round(t, 3) for t in times],
                                     "encoder": encoders[name]}
                              for name, times in runs.items()}  # fmt: skip
            for name, row in figures[label].items():
                print(f"{label:<20} {name:<8} best {row['best_s']:7.2f} s  {row['encoder']}")
    record_result("bench_setup", figures, args)


if __name__ == "__main__":
    main()
