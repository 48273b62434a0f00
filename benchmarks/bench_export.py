"""How fast `shardcache export` writes, and how the HF writer compares with `datasets` itself.

    python benchmarks/bench_export.py --cache CACHE [--repeat 3]
    python benchmarks/bench_export.py --copies 20     # builds a cache of the quickstart corpus x20

Each variant runs in a fresh process (so its peak RSS is its own), rounds interleaved, best of
``--repeat``:

* ``megatron``: ``export_cache(..., ExportOptions("megatron"))``;
* ``hf``: ``export_cache(..., ExportOptions("hf"))`` (Arrow stream files written directly);
* ``hf_from_generator``: ``datasets.Dataset.from_generator`` over the cache's sequences (read in
  the same chunks) with the same features, then ``save_to_disk``: what the writer would be if
  it used ``datasets`` (which writes the data twice: its cache folder, then the output).

Figures: seconds, million tokens per second, peak RSS (MiB) of the process, and the output's
bytes; the hf outputs are checked equal by reading both with ``datasets.load_from_disk``.
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

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_variant(variant: str, cache_path: str, out: str) -> None:
    """Run one export in this process and print its seconds and peak RSS as JSON."""
    import resource

    import numpy as np

    from shardcache.store.cache import open_cache
    from shardcache.store.export import ExportOptions, _chunks, export_cache

    start = time.perf_counter()
    if variant in ("megatron", "hf"):
        export_cache(cache_path, out, ExportOptions(variant))
    else:
        import datasets

        with open_cache(cache_path) as cache:
            mask = cache.has_mask

            def rows():
                for lo, hi in _chunks(cache.lengths, 0, cache.num_sequences, 1 << 24):
                    got = cache.gather(np.arange(lo, hi), with_mask=mask, dtype=np.int32)
                    for k, ids in enumerate(np.split(got.tokens, got.offsets[1:-1])):
                        row = {"input_ids": ids}
                        if got.mask is not None:
                            a, b = got.offsets[k], got.offsets[k + 1]
                            row["loss_mask"] = got.mask[a:b].view(np.int8)
                        yield row

            features = {"input_ids": datasets.List(datasets.Value("int32"))}
            if mask:
                features["loss_mask"] = datasets.List(datasets.Value("int8"))
            with tempfile.TemporaryDirectory() as hf_cache:
                ds = datasets.Dataset.from_generator(
                    rows, features=datasets.Features(features), cache_dir=hf_cache
                )
                ds.save_to_disk(out)
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"seconds": seconds, "peak_rss_mib": peak}))


def folder_bytes(path: str) -> int:
    if os.path.isfile(path + ".bin"):
        return os.path.getsize(path + ".bin") + os.path.getsize(path + ".idx")
    return sum(os.path.getsize(os.path.join(path, n)) for n in os.listdir(path))


def build_copies(copies: int, work: str) -> str:
    corpus = os.path.join(work, "corpus")
    os.makedirs(corpus)
    src = os.path.join(REPO, "recipes", "quickstart", "corpus")
    for k in range(copies):
        for name in os.listdir(src):
            shutil.copy(os.path.join(src, name), os.path.join(corpus, f"c{k:03d}-{name}"))
    out = os.path.join(work, "cache")
    subprocess.run(
        [sys.executable, "-m", "shardcache", "build", "-i", corpus, "-t",
         os.path.join(REPO, "recipes", "quickstart", "tokenizer"), "-o", out,
         "--max-length", "512", "--truncation", "split", "-q"],
        check=True, stdout=subprocess.DEVNULL,
    )  # fmt: skip
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cache", help="an existing cache (default: build one, see --copies)")
    ap.add_argument("--copies", type=int, default=20, help="quickstart corpus copies to build")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--run", nargs=3, metavar=("VARIANT", "CACHE", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.run:
        run_variant(*args.run)
        return
    work = tempfile.mkdtemp(prefix="bench-export-")
    try:
        cache_path = args.cache or build_copies(args.copies, work)
        from shardcache.store.cache import open_cache

        with open_cache(cache_path) as cache:
            tokens, sequences = cache.num_tokens, cache.num_sequences
        variants = ["megatron", "hf", "hf_from_generator"]
        best: dict[str, dict] = {}
        sizes: dict[str, int] = {}
        for r in range(args.repeat):
            for variant in variants:
                out = os.path.join(work, f"{variant}-{r}")
                done = subprocess.run(
                    [sys.executable, __file__, "--run", variant, cache_path, out],
                    check=True, capture_output=True, text=True,
                )  # fmt: skip
                got = json.loads(done.stdout.strip().splitlines()[-1])
                sizes[variant] = folder_bytes(out)
                if variant not in best or got["seconds"] < best[variant]["seconds"]:
                    best[variant] = got
                if r < args.repeat - 1 or variant == "megatron":
                    shutil.rmtree(out, ignore_errors=True)
                    for ext in (".bin", ".idx"):
                        if os.path.exists(out + ext):
                            os.remove(out + ext)
        import datasets

        last = args.repeat - 1
        a = datasets.load_from_disk(os.path.join(work, f"hf-{last}"))
        b = datasets.load_from_disk(os.path.join(work, f"hf_from_generator-{last}"))
        assert a.data.table.equals(b.data.table), "the hf outputs differ"
        figures = {"sequences": sequences, "tokens": tokens}
        for variant, got in best.items():
            figures[variant] = {
                "seconds": round(got["seconds"], 3),
                "mtokens_per_s": round(tokens / got["seconds"] / 1e6, 2),
                "peak_rss_mib": round(got["peak_rss_mib"], 1),
                "output_bytes": sizes[variant],
            }
        print(json.dumps(figures, indent=1))
        record_result("bench_export", figures, args)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
