"""Build throughput vs. the tokenizer's own ``encode_batch`` ceiling (not part of the tests).

    python benchmarks/bench_build.py --corpus /tmp/corpus-20k \
        --tokenizer ../shared/fixtures/tokenizers/minilm-wordpiece
    # make the corpus first, e.g.:
    python ../shared/bench/make_corpus.py /tmp/corpus-20k --docs 20000 --files 8 --format jsonl.zst

Measured in one run, on the same texts and the same tokenizer:

* ``ceiling``: ``Tokenizer.encode_batch`` (the Rust backend, all cores) over the texts already
  in memory, in batches of ``--batch-docs``, including nothing else;
* ``build (in-process)``: ``shardcache.build_cache`` on the corpus files after the imports are
  warm: read + decompress + parse + encode + EOS/truncation + bucket + write + commit;
* ``build (CLI)``: the ``shardcache build`` command in a fresh process, wall time and peak RSS
  (interpreter start and the transformers import included).

The ratio ``build / ceiling`` (tokens/s) is the figure of merit (target >= 0.85).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time


def load_texts(corpus: str, text_field: str) -> list[str]:
    from shardcache.sources import iter_text_batches, list_inputs

    texts: list[str] = []
    for f in list_inputs([corpus]):
        for batch in iter_text_batches(f, text_field=text_field):
            texts += batch.texts
    return texts


def ceiling(tokenizer: str, texts: list[str], batch_docs: int) -> tuple[float, int]:
    from shardcache.config import TokenizeOptions
    from shardcache.tokenize import TextEncoder

    backend = TextEncoder(TokenizeOptions(tokenizer)).backend
    tokens = 0
    start = time.perf_counter()
    for i in range(0, len(texts), batch_docs):
        for encoding in backend.encode_batch(texts[i : i + batch_docs]):
            tokens += len(encoding)
    return time.perf_counter() - start, tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--corpus", required=True, help="folder of input files")
    ap.add_argument("--tokenizer", required=True, help="local tokenizer folder")
    ap.add_argument("--text-field", default="text")
    ap.add_argument("--batch-docs", type=int, default=1024)
    ap.add_argument("--repeat", type=int, default=2, help="runs of each; the best is reported")
    ap.add_argument("--extra", nargs=argparse.REMAINDER, default=[],
                    help="extra `shardcache build` flags (after --extra)")  # fmt: skip
    args = ap.parse_args()

    from shardcache.build import build_cache
    from shardcache.config import build_options_from_mapping

    corpus_bytes = sum(
        os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(args.corpus) for f in fs
    )
    texts = load_texts(args.corpus, args.text_field)
    text_mb = sum(len(t.encode()) for t in texts) / 1e6
    work = tempfile.mkdtemp(prefix="bench-build-")
    try:
        ceil_s, ceil_tokens = min(
            ceiling(args.tokenizer, texts, args.batch_docs) for _ in range(args.repeat)
        )
        del texts
        best = None
        for i in range(args.repeat):
            values = {"input": args.corpus, "tokenizer": args.tokenizer,
                      "output": os.path.join(work, f"c{i}"), "text_field": args.text_field,
                      "batch_docs": args.batch_docs}  # fmt: skip
            report = build_cache(build_options_from_mapping(values))
            best = report if best is None or report.seconds < best.seconds else best
        assert best is not None
        out = os.path.join(work, "cli")
        cmd = [sys.executable, "-m", "shardcache.cli", "build", "-i", args.corpus,
               "-t", args.tokenizer, "-o", out, "--text-field", args.text_field, "-q", "--json",
               *args.extra]  # fmt: skip
        start = time.perf_counter()
        result = subprocess.run(cmd, capture_output=True, text=True, check=True)
        cli_s = time.perf_counter() - start
        cli_report = json.loads(result.stdout)
        peak_rss_mb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    finally:
        shutil.rmtree(work, ignore_errors=True)

    build_tps = best.tokens / best.seconds
    ceil_tps = ceil_tokens / ceil_s
    rows = [
        ("ceiling: encode_batch", f"{ceil_tps:,.0f}", f"{text_mb / ceil_s:.2f}", "-", "1.00"),
        ("build (in-process)", f"{build_tps:,.0f}", f"{text_mb / best.seconds:.2f}", "-",
         f"{build_tps / ceil_tps:.2f}"),
        ("build (CLI, cold start)", f"{cli_report['tokens'] / cli_s:,.0f}",
         f"{text_mb / cli_s:.2f}", f"{peak_rss_mb:,.0f}",
         f"{cli_report['tokens'] / cli_s / ceil_tps:.2f}"),
    ]  # fmt: skip
    print(
        f"corpus {args.corpus}: {best.documents:,} docs, {text_mb:.1f} MB text, "
        f"{corpus_bytes / 1e6:.1f} MB on disk, {best.tokens:,} tokens; cores {os.cpu_count()}"
    )
    print("| run | tokens/s | text MB/s | peak RSS MB | ratio |")
    print("|---|---:|---:|---:|---:|")
    for row in rows:
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
