"""Build throughput, process scaling and peak memory (not part of the tests).

    python benchmarks/bench_build.py --corpus CORPUS [--corpus-large CORPUS_5X] \
        --tokenizer TOKENIZER_DIR [--hf-python VENV/bin/python]

``CORPUS`` is a folder of ``.jsonl.zst`` files (e.g. 100,000 documents in 8 files),
``CORPUS_5X`` a five times larger one for the peak-RSS row.

Rows (every build is a fresh ``shardcache build`` process; tokens/s = stored tokens / the
build's own time, from the start of ``build_cache`` (tokenizer load included) to the
manifest; ``wall`` adds interpreter start and imports):

* ``ceiling``: ``Tokenizer.encode_batch`` (Rust backend, Rayon on all cores) over the texts
  already in memory, in batches of ``--batch-docs``, nothing else. The figure of merit is
  build / ceiling (target >= 0.85 at N = 2).
* ``workers=1, 1 core``: the in-process build with ``RAYON_NUM_THREADS=1``: one core's worth
  of tokenizer, the base of the scaling ratio.
* ``workers=N``: N spawned worker processes, each with ``RAYON_NUM_THREADS = cores // N``.
  scaling = tokens/s(N) / tokens/s(1 core) (target >= 1.7 at N = 2 on 2 cores).
* ``workers=1, all cores``: the in-process build, the tokenizer's Rayon pool on every core.
* peak RSS: the sum of VmRSS over the build's process tree, sampled every 50 ms (the parent
  and its workers), for ``--corpus`` and ``--corpus-large`` at the default worker count.
* ``HF datasets``: ``load_dataset("json") -> map(batched=True, num_proc=2) -> save_to_disk``
  with the same tokenizer, run by ``--hf-python`` (an interpreter with ``datasets``).

Encoder backends (issue 14), ``--encoders hf,fast [--repeat 3]``: in one run, interleaved,
``--repeat`` rounds of (ceiling, build --encoder hf, build --encoder fast, ...), best of each.
The ceiling is HF ``encode_batch`` over the texts preloaded in memory
(``add_special_tokens=False``), timed alone; a build is the whole ``shardcache build``
process (``seconds`` from its report, and wall with interpreter start), with its peak tree
RSS. ``x ceiling`` = ceiling seconds / build seconds (goal: >= 5 with the fast backend,
>= 0.95 with HF). ``--profile`` adds one in-process fast build under cProfile (main thread;
the encode thread's time shows as lock waits) with the top functions::

    python benchmarks/bench_build.py --corpus /tmp/c20k --tokenizer /tmp/tok151k \
        --encoders hf,fast --repeat 3 --workers-encoders 1 [--profile]

The build against fastokens alone, ``--vs-fast [--repeat 3]``: in one run, interleaved, best
of each, fastokens ``encode_batch_flat`` over the texts preloaded in memory (batches of
``--batch-docs``, ``add_special_tokens=False``; the ceiling of any build encoding with it) and
``shardcache build`` with default options (fast backend, verification on); prints the ratio
(goal >= 0.4), the verification's documents, tokens and share of the build's CPU, and the
build's CPU per stage::

    python benchmarks/bench_build.py --corpus CORPUS --tokenizer TOKDIR --vs-fast --repeat 3

The floor of any Python build on this machine, ``--floor [--repeat 3]``: in one run,
interleaved, best of each, fastokens alone (as ``--vs-fast``), the leanest pipeline a Python
build could be, cut after each of its steps, and ``shardcache build`` with default options.
The lean pipeline runs two input files at a time in threads (the build's partitions in
flight); per file it stream-decompresses the ``.jsonl.zst`` (1 MiB reads), splits lines,
takes each line's ``text`` with ``orjson``, encodes batches of ``--batch-docs`` with fastokens
``encode_batch_flat``, appends one EOS per document (id 0: the value does not change the
cost) in numpy as the store's dtype, and writes the ids through sha256 to one file, fsynced
once. It has no verification, buckets, Arrow, tokenizer load, manifest or error handling, so
no build that reads through Python strings can beat its last row::

    python benchmarks/bench_build.py --corpus CORPUS --tokenizer TOKDIR --floor --repeat 3
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

from results import record_result

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

HF_SCRIPT = r"""
import sys, time, os
start = time.perf_counter()
from datasets import load_dataset, disable_caching
from transformers import AutoTokenizer
disable_caching()
corpus, tokenizer, out = sys.argv[1:4]
files = sorted(os.path.join(corpus, f) for f in os.listdir(corpus) if f.endswith(".jsonl.zst"))
tok = AutoTokenizer.from_pretrained(tokenizer)
ds = load_dataset("json", data_files=files, split="train", cache_dir=out + "-hfcache")
def enc(batch):
    return {"input_ids": tok(batch["text"])["input_ids"]}
ds = ds.map(enc, batched=True, batch_size=1024, num_proc=2, remove_columns=ds.column_names)
ds.save_to_disk(out)
print(time.perf_counter() - start)
"""


def _tree_rss_kib(root: int) -> int:
    """Sum of VmRSS (KiB) over ``root`` and its descendants (Linux /proc)."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(name))
    total, stack = 0, [root]
    while stack:
        pid = stack.pop()
        stack += children.get(pid, [])
        try:
            with open(f"/proc/{pid}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1])
        except OSError:
            pass
    return total


def run_measured(cmd: list[str], env: dict[str, str]) -> tuple[float, float, str]:
    """Run ``cmd``; returns (wall seconds, peak tree RSS MiB, stdout)."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=REPO)  # fmt: skip
    peak = 0
    done = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, _tree_rss_kib(proc.pid))
            done.wait(0.05)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    out, err = proc.communicate()
    wall = time.perf_counter() - start
    done.set()
    sampler.join()
    if proc.returncode != 0:
        raise SystemExit(f"{cmd} failed ({proc.returncode}):\n{err[-3000:]}")
    return wall, peak / 1024, out


def build(corpus: str, tokenizer: str, out: str, workers: int | None, env_extra: dict[str, str],
          batch_docs: int, extra: tuple[str, ...] = ()) -> tuple[dict, float, float]:  # fmt: skip
    """One ``shardcache build`` process (``workers`` None: the build's own default)."""
    shutil.rmtree(out, ignore_errors=True)
    env = {**os.environ, "PYTHONPATH": REPO, **env_extra}
    cmd = [sys.executable, "-m", "shardcache.cli", "build", "-i", corpus, "-t", tokenizer,
           "-o", out, "-q", "--json", "--batch-docs", str(batch_docs), *extra]  # fmt: skip
    if workers is not None:
        cmd += ["--workers", str(workers)]
    wall, rss, stdout = run_measured(cmd, env)
    return json.loads(stdout), wall, rss


def ceiling(corpus: str, tokenizer: str, batch_docs: int) -> tuple[float, int, float]:
    from shardcache.builder.sources import iter_text_batches, list_inputs
    from shardcache.builder.tokenize import TextEncoder
    from shardcache.config import TokenizeOptions

    texts: list[str] = []
    for f in list_inputs([corpus]):
        for batch in iter_text_batches(f):
            texts += batch.texts
    backend = TextEncoder(TokenizeOptions(tokenizer)).backend
    tokens = 0
    start = time.perf_counter()
    for i in range(0, len(texts), batch_docs):
        for encoding in backend.encode_batch(texts[i : i + batch_docs]):
            tokens += len(encoding)
    return time.perf_counter() - start, tokens, sum(len(t.encode()) for t in texts) / 1e6


def load_texts(corpus: str) -> list[str]:
    from shardcache.builder.sources import iter_text_batches, list_inputs

    texts: list[str] = []
    for f in list_inputs([corpus]):
        for batch in iter_text_batches(f):
            texts += batch.texts
    return texts


def hf_ceiling_seconds(backend, texts: list[str], batch_docs: int) -> tuple[float, int]:
    """HF encode_batch over preloaded texts (add_special_tokens=False), nothing else."""
    tokens = 0
    start = time.perf_counter()
    for i in range(0, len(texts), batch_docs):
        for encoding in backend.encode_batch(texts[i : i + batch_docs], add_special_tokens=False):
            tokens += len(encoding)
    return time.perf_counter() - start, tokens


def compare_encoders(args: argparse.Namespace) -> None:
    """Ceiling and builds per encoder, interleaved, best of ``--repeat`` (see the docstring)."""
    from tokenizers import Tokenizer

    from shardcache.builder.tokenize import TextEncoder
    from shardcache.config import TokenizeOptions

    texts = load_texts(args.corpus)
    backend = Tokenizer.from_str(TextEncoder(TokenizeOptions(args.tokenizer)).backend.to_str())
    encoders = args.encoders.split(",")
    best: dict[str, tuple[float, float, float, dict]] = {}
    ceiling_s, tokens = float("inf"), 0
    work = tempfile.mkdtemp(prefix="bench-encoders-")
    try:
        for _ in range(args.repeat):
            seconds, tokens = hf_ceiling_seconds(backend, texts, args.batch_docs)
            ceiling_s = min(ceiling_s, seconds)
            for name in encoders:
                extra = ("--encoder", name, "--no-add-special-tokens")
                out = os.path.join(work, name)
                workers = args.workers_encoders
                report, wall, rss = build(
                    args.corpus, args.tokenizer, out, workers, {}, args.batch_docs, extra
                )
                seconds = report["seconds"]
                if name not in best or seconds < best[name][0]:
                    best[name] = (seconds, wall, max(rss, best.get(name, (0, 0, 0))[2]), report)
                else:
                    best[name] = (*best[name][:2], max(rss, best[name][2]), best[name][3])
    finally:
        shutil.rmtree(work, ignore_errors=True)
    mb = sum(len(t.encode()) for t in texts) / 1e6
    print(f"corpus {args.corpus}: {len(texts):,} documents, {mb:.1f} MB text, {tokens:,} tokens; "
          f"cores {os.cpu_count()}; best of {args.repeat}, interleaved; "
          f"workers={args.workers_encoders}")  # fmt: skip
    print("| run | seconds | wall s | x ceiling | peak RSS MiB | backend | verified | mismatches |")
    print("|---|---:|---:|---:|---:|---|---:|---:|")
    print(f"| HF encode_batch, texts preloaded (ceiling) | {ceiling_s:.2f} | - | 1.00 | - | hf "
          f"| - | - |")  # fmt: skip
    for name, (seconds, wall, rss, report) in best.items():
        enc = report.get("encoder") or {}
        used = ", ".join(f"{k} x{v}" for k, v in (enc.get("partitions_by_backend") or {}).items())
        print(f"| shardcache build --encoder {name} | {seconds:.2f} | {wall:.1f} | "
              f"{ceiling_s / seconds:.2f} | {rss:,.0f} | {used} | "
              f"{enc.get('documents_verified', 0):,} | {enc.get('mismatches', 0)} |")  # fmt: skip
    print_stages({f"--encoder {name}": report for name, (_, _, _, report) in best.items()})
    record_result("bench_build --encoders", {
        "documents": len(texts), "tokens": tokens, "ceiling_seconds": ceiling_s,
        "builds": {name: {"seconds": s, "wall_seconds": w, "peak_rss_mib": r,
                          "encoder": report.get("encoder"),
                          "stages_cpu_seconds": report.get("stages")}
                   for name, (s, w, r, report) in best.items()},
    }, args)  # fmt: skip
    if args.profile:
        profile_fast_build(args)


def fast_alone_seconds(texts: list[str], tokenizer: str, batch_docs: int) -> tuple[float, int]:
    """fastokens ``encode_batch_flat`` over preloaded texts (load not timed): (seconds, ids)."""
    import fastokens

    tok = fastokens.Tokenizer.from_file(os.path.join(tokenizer, "tokenizer.json"))
    ids = 0
    start = time.perf_counter()
    for i in range(0, len(texts), batch_docs):
        ids += len(tok.encode_batch_flat(texts[i : i + batch_docs], add_special_tokens=False)[0])
    return time.perf_counter() - start, ids // 4  # uint32 ids as bytes


def compare_fast(args: argparse.Namespace) -> None:
    """fastokens alone and a default build, interleaved, best of ``--repeat`` (see above)."""
    texts = load_texts(args.corpus)
    mb = sum(len(t.encode()) for t in texts) / 1e6
    fast_s, build_s, best, tokens = float("inf"), float("inf"), (0.0, 0.0, {}), 0
    work = tempfile.mkdtemp(prefix="bench-vs-fast-")
    try:
        for _ in range(args.repeat):
            seconds, tokens = fast_alone_seconds(texts, args.tokenizer, args.batch_docs)
            fast_s = min(fast_s, seconds)
            out = os.path.join(work, "c")
            report, wall, rss = build(args.corpus, args.tokenizer, out, None, {}, args.batch_docs)
            if report["seconds"] < build_s:
                build_s, best = report["seconds"], (wall, rss, report)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    wall, rss, report = best
    enc, stages = report.get("encoder") or {}, report.get("stages") or {}
    cpu = sum(stages.get(n, 0.0) for n in ("startup", "read", "parse", "tokenizer", "bucket",
                                            "write", "commit"))  # fmt: skip
    print(
        f"corpus {args.corpus}: {len(texts):,} documents, {mb:.1f} MB text, {tokens:,} "
        f"tokens (w/o EOS); cores {os.cpu_count()}; best of {args.repeat}, interleaved"
    )
    print("| run | seconds | wall s | MB/s | x fastokens alone | peak RSS MiB |")
    print("|---|---:|---:|---:|---:|---:|")
    print(
        f"| fastokens encode_batch_flat, texts preloaded | {fast_s:.2f} | - | "
        f"{mb / fast_s:.0f} | 1.00 | - |"
    )
    print(
        f"| shardcache build (default options) | {build_s:.2f} | {wall:.1f} | "
        f"{mb / build_s:.0f} | {fast_s / build_s:.2f} | {rss:,.0f} |"
    )
    print(
        f"verified {enc.get('documents_verified', 0):,} documents, "
        f"{enc.get('tokens_verified', 0):,} tokens (share {enc.get('verify_fraction', 0):g}), "
        f"{enc.get('mismatches', 0)} mismatches; verify busy "
        f"{stages.get('verify_busy', 0.0):.2f} s of {cpu:.2f} CPU-s in the stages"
    )
    print_stages({"default": report})
    record_result("bench_build --vs-fast", {
        "documents": len(texts), "text_mb": mb, "tokens": tokens, "fast_alone_seconds": fast_s,
        "build_seconds": build_s, "wall_seconds": wall, "peak_rss_mib": rss,
        "ratio_to_fast_alone": fast_s / build_s, "encoder": enc, "stages_cpu_seconds": stages,
    }, args)  # fmt: skip


#: The lean pipeline's steps (``--floor``), each row adding one to the ones before.
FLOOR_STEPS = (
    "decompress, split lines",
    "+ orjson: each line's text",
    "+ fastokens encode_batch_flat",
    "+ EOS per document, store dtype",
    "+ sha256, write, one fsync per file",
)


def _zst_lines(path: str):
    """The lines of a ``.jsonl.zst`` file, decompressed 1 MiB of input at a time."""
    import zstandard

    with open(path, "rb") as f:
        reader = zstandard.ZstdDecompressor().stream_reader(f, read_size=1 << 20)
        rest = b""
        while block := reader.read(1 << 22):
            block = rest + block
            cut = block.rfind(b"\n") + 1
            rest = block[cut:]
            yield from block[:cut].splitlines()
        if rest:
            yield rest


def lean_pipeline_seconds(files: list[str], tok, dtype, steps: int, out: str,
                          batch_docs: int) -> float:  # fmt: skip
    """The lean pipeline (``--floor``) over ``files``, two at a time, up to step ``steps``
    (1-based, :data:`FLOOR_STEPS`): wall seconds."""
    import hashlib
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np
    import orjson

    def one_file(path: str) -> None:
        digest = hashlib.sha256()  # its cost is measured; the digest itself is not needed

        def encode(texts: list[str]) -> None:
            ids, offsets = tok.encode_batch_flat(texts, add_special_tokens=False)
            if steps >= 4:
                ends = np.frombuffer(offsets, "<u8")[1:].astype(np.int64)
                tokens = np.insert(np.frombuffer(ids, "<u4"), ends, 0).astype(dtype)
                if steps >= 5:
                    digest.update(tokens)
                    f.write(tokens)

        with open(os.path.join(out, os.path.basename(path) + ".ids"), "wb") as f:
            texts: list[str] = []
            for line in _zst_lines(path):
                if steps < 2:
                    continue
                texts.append(orjson.loads(line)["text"])
                if len(texts) == batch_docs:
                    if steps >= 3:
                        encode(texts)
                    texts = []
            if texts and steps >= 3:
                encode(texts)
            f.flush()
            os.fsync(f.fileno())

    os.makedirs(out, exist_ok=True)
    start = time.perf_counter()
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(one_file, files))  # re-raises a file's error
    return time.perf_counter() - start


def compare_floor(args: argparse.Namespace) -> None:
    """fastokens alone, the lean pipeline step by step and a default build, interleaved, best
    of ``--repeat`` (see above)."""
    import fastokens
    import numpy as np

    files = sorted(os.path.join(args.corpus, f) for f in os.listdir(args.corpus)
                   if f.endswith(".jsonl.zst"))  # fmt: skip
    if not files:
        raise SystemExit(f"--floor reads .jsonl.zst files; {args.corpus} has none")
    texts = load_texts(args.corpus)
    mb = sum(len(t.encode()) for t in texts) / 1e6
    tok = fastokens.Tokenizer.from_file(os.path.join(args.tokenizer, "tokenizer.json"))
    tok.no_truncation()
    tok.no_padding()
    dtype = np.uint16 if tok.vocab_size <= 65536 else np.uint32
    best = {name: float("inf") for name in ("fast", *FLOOR_STEPS, "build")}
    work = tempfile.mkdtemp(prefix="bench-floor-")
    try:
        for _ in range(args.repeat):
            best["fast"] = min(best["fast"], fast_alone_seconds(texts, args.tokenizer,
                                                                args.batch_docs)[0])  # fmt: skip
            for k, name in enumerate(FLOOR_STEPS, start=1):
                lean = os.path.join(work, "lean")
                seconds = lean_pipeline_seconds(files, tok, dtype, k, lean, args.batch_docs)
                shutil.rmtree(lean)
                best[name] = min(best[name], seconds)
            report, _, _ = build(args.corpus, args.tokenizer, os.path.join(work, "c"), None, {},
                                 args.batch_docs)  # fmt: skip
            best["build"] = min(best["build"], report["seconds"])
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"corpus {args.corpus}: {len(texts):,} documents, {mb:.1f} MB text, {len(files)} "
          f"files; cores {os.cpu_count()}; best of {args.repeat}, interleaved")  # fmt: skip
    print("| run | seconds | MB/s | x fastokens alone |")
    print("|---|---:|---:|---:|")
    rows = [("fastokens encode_batch_flat, texts preloaded", best["fast"])]
    rows += [(f"lean pipeline: {name}", best[name]) for name in FLOOR_STEPS]
    rows.append(("shardcache build (default options)", best["build"]))
    for label, seconds in rows:
        print(f"| {label} | {seconds:.2f} | {mb / seconds:.0f} | {best['fast'] / seconds:.2f} |")
    record_result("bench_build --floor", {
        "documents": len(texts), "text_mb": mb, "files": len(files),
        "seconds": {label: seconds for label, seconds in rows},
        "ratio_to_fast_alone": {label: best["fast"] / seconds for label, seconds in rows},
    }, args)  # fmt: skip


def print_stages(reports: dict[str, dict]) -> None:
    """Per-stage CPU seconds of each build (its report's ``stages``): where a build's CPU
    goes, a figure that stays meaningful on a loaded machine; ``share`` of the stages' sum."""
    names = ("startup", "read", "parse", "tokenizer", "bucket", "write", "commit")
    print("| build | " + " | ".join(names) + " | encode busy s | verify busy s |")
    print("|---|" + "---:|" * (len(names) + 2))
    for name, report in reports.items():
        stages = report.get("stages") or {}
        total = sum(stages.get(n, 0.0) for n in names) or 1.0
        cells = [f"{stages.get(n, 0.0):.2f} ({100 * stages.get(n, 0.0) / total:.0f}%)"
                 for n in names]  # fmt: skip
        busy = [f"{stages.get(n, 0.0):.2f}" for n in ("encode_busy", "verify_busy")]
        print(f"| {name} | " + " | ".join([*cells, *busy]) + " |")


def profile_fast_build(args: argparse.Namespace) -> None:
    import cProfile
    import pstats

    from shardcache.builder.run import build_cache
    from shardcache.config import build_options_from_mapping

    out = tempfile.mkdtemp(prefix="bench-profile-")
    try:
        options = build_options_from_mapping({
            "input": args.corpus, "tokenizer": args.tokenizer, "output": out + "/c",
            "workers": 1, "encoder": "fast", "add_special_tokens": False,
            "batch_docs": args.batch_docs,
        })  # fmt: skip
        profile = cProfile.Profile()
        profile.enable()
        build_cache(options)
        profile.disable()
    finally:
        shutil.rmtree(out, ignore_errors=True)
    pstats.Stats(profile).sort_stats("tottime").print_stats(20)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--corpus", required=True, help="folder of input files")
    ap.add_argument("--corpus-large", help="a larger corpus (e.g. 5x) for the peak-RSS row")
    ap.add_argument("--tokenizer", required=True, help="local tokenizer folder")
    ap.add_argument("--batch-docs", type=int, default=1024)
    ap.add_argument("--workers", default="1,2", help="worker counts to sweep (comma-separated)")
    ap.add_argument("--hf-python", help="python with `datasets` installed, for the HF row")
    ap.add_argument("--encoders", help="compare encoder backends instead, e.g. hf,fast")
    ap.add_argument("--repeat", type=int, default=3, help="--encoders/--vs-fast/--floor: best of")
    ap.add_argument(
        "--workers-encoders",
        type=int,
        default=1,
        help="--encoders: build processes (1: in-process, fast backend threads)",
    )
    ap.add_argument("--profile", action="store_true", help="--encoders: profile a fast build")
    ap.add_argument("--vs-fast", action="store_true", help="a build against fastokens alone")
    ap.add_argument(
        "--floor", action="store_true", help="the lean pipeline and a build vs fastokens alone"
    )
    args = ap.parse_args()
    if args.floor:
        compare_floor(args)
        return
    if args.vs_fast:
        compare_fast(args)
        return
    if args.encoders:
        compare_encoders(args)
        return
    cores = os.cpu_count() or 1
    work = tempfile.mkdtemp(prefix="bench-build-")
    rows: list[tuple[str, ...]] = []
    try:
        ceil_s, ceil_tokens, text_mb = ceiling(args.corpus, args.tokenizer, args.batch_docs)
        ceil_tps = ceil_tokens / ceil_s
        rows.append(("ceiling: encode_batch, all cores", f"{ceil_tps:,.0f}", "-", "-", "-",
                     "1.00"))  # fmt: skip
        base_tps = None
        out = os.path.join(work, "c")
        for n in [int(w) for w in args.workers.split(",")]:
            env = {"RAYON_NUM_THREADS": "1"} if n == 1 else {}
            label = f"workers={n}" + (", 1 core (RAYON_NUM_THREADS=1)" if n == 1 else
                                      f", {max(1, cores // n)} Rayon thread(s) each")  # fmt: skip
            report, wall, rss = build(args.corpus, args.tokenizer, out, n, env, args.batch_docs)
            tps = report["tokens"] / report["seconds"]
            base_tps = base_tps or tps
            rows.append((label, f"{tps:,.0f}", f"{wall:.1f}", f"{rss:,.0f}",
                         f"{tps / base_tps:.2f}", f"{tps / ceil_tps:.2f}"))  # fmt: skip
        report, wall, rss = build(args.corpus, args.tokenizer, out, 1, {}, args.batch_docs)
        tps = report["tokens"] / report["seconds"]
        rows.append(("workers=1, Rayon on all cores (in-process)", f"{tps:,.0f}", f"{wall:.1f}",
                     f"{rss:,.0f}", f"{tps / (base_tps or tps):.2f}",
                     f"{tps / ceil_tps:.2f}"))  # fmt: skip
        rss_rows = []
        for name, corpus in (("1x", args.corpus), ("large", args.corpus_large)):
            if not corpus:
                continue
            report, wall, rss = build(corpus, args.tokenizer, out, cores, {}, args.batch_docs)
            rss_rows.append((name, corpus, report["documents"], report["tokens"], wall, rss))
        if args.hf_python:
            hf_out = os.path.join(work, "hf")
            env = {**os.environ, "HF_DATASETS_OFFLINE": "1"}
            cmd = [args.hf_python, "-c", HF_SCRIPT, args.corpus, args.tokenizer, hf_out]
            wall, rss, stdout = run_measured(cmd, env)
            inner = float(stdout.strip().splitlines()[-1])
            tokens = rss_rows[0][3] if rss_rows else ceil_tokens  # same tokenizer, same ids
            tps = tokens / inner
            rows.append(("HF datasets map(num_proc=2)+save_to_disk", f"{tps:,.0f}",
                         f"{wall:.1f}", f"{rss:,.0f}", f"{tps / (base_tps or tps):.2f}",
                         f"{tps / ceil_tps:.2f}"))  # fmt: skip
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"corpus {args.corpus}: {text_mb:.1f} MB text, {ceil_tokens:,} tokens (w/o EOS); "
          f"cores {cores}")  # fmt: skip
    print("| run | tokens/s | wall s | peak RSS MiB | vs 1 core | vs ceiling |")
    print("|---|---:|---:|---:|---:|---:|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    if rss_rows:
        print()
        print(f"| corpus | documents | tokens | wall s | peak RSS MiB (tree, workers={cores}) |")
        print("|---|---:|---:|---:|---:|")
        for name, corpus, docs, tokens, wall, rss in rss_rows:
            print(f"| {name} {corpus} | {docs:,} | {tokens:,} | {wall:.1f} | {rss:,.0f} |")
    header = ("run", "tokens_per_s", "wall_seconds", "peak_rss_mib", "vs_1_core", "vs_ceiling")
    record_result("bench_build", {
        "text_mb": text_mb, "ceiling_tokens": ceil_tokens,
        "rows": [dict(zip(header, row)) for row in rows],
        "peak_rss": [{"corpus": c, "documents": d, "tokens": t, "wall_seconds": w,
                      "peak_rss_mib": r} for _, c, d, t, w, r in rss_rows],
    }, args)  # fmt: skip


if __name__ == "__main__":
    main()
