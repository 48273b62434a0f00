"""Distributed build and object storage: what they cost against the local paths.

1. Build overhead of the Ray engine: a local Ray cluster with 2 CPUs (``ray.init(num_cpus=2)``,
   started before timing) against the local process pool with 2 workers, same corpus and
   options; both outputs are checked byte-identical.
2. Read throughput from a loopback S3 server (moto's standalone server on 127.0.0.1) against
   local disk: a cold full pass (downloads + sha256 into the local shard cache), a warm pass
   (cache hit), and the local folder; plus ``verify`` on both.

    PYTHONPATH=. python benchmarks/bench_remote.py --docs 20000 --files 8

Not collected by pytest. Needs ray, s3fs, moto[server], boto3.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))


def make_corpus(folder: str, files: int, docs: int) -> None:
    from conftest import make_texts, write_records

    os.makedirs(folder)
    for f in range(files):
        texts = make_texts(docs // files, seed=f, max_words=400)
        write_records(os.path.join(folder, f"part-{f:03d}.jsonl"), [{"text": t} for t in texts],
                      "jsonl")  # fmt: skip


def make_tokenizer(folder: str) -> str:
    from conftest import _save_bpe, make_texts

    return _save_bpe(folder, make_texts(2000, seed=7), vocab_size=2000, bos=False)


def tree(folder: str) -> dict[str, bytes]:
    out = {}
    for root, _, names in os.walk(folder):
        for n in names:
            with open(os.path.join(root, n), "rb") as f:
                out[os.path.relpath(os.path.join(root, n), folder)] = f.read()
    return out


def timed(fn):  # type: ignore[no-untyped-def]
    start = time.perf_counter()
    value = fn()
    return time.perf_counter() - start, value


def read_all(path: str) -> int:
    from shardcache import open_cache

    return sum(int(s.ids.nbytes) for s in open_cache(path).iter_sequences())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--docs", type=int, default=20000)
    parser.add_argument("--files", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()

    import boto3
    import ray
    from moto.server import ThreadedMotoServer

    from shardcache import verify_cache
    from shardcache.build.engines import EngineOptions
    from shardcache.build.run import build
    from shardcache.config import build_options_from_mapping

    work = tempfile.mkdtemp(prefix="bench-remote-")
    os.environ["SHARDCACHE_CACHE_DIR"] = os.path.join(work, "local-cache")
    corpus, tok = os.path.join(work, "corpus"), make_tokenizer(os.path.join(work, "tok"))
    make_corpus(corpus, args.files, args.docs)
    size = sum(os.path.getsize(os.path.join(corpus, n)) for n in os.listdir(corpus))
    print(f"corpus: {args.files} files, {args.docs} docs, {size / 1e6:.1f} MB; "
          f"cpus {os.cpu_count()}")  # fmt: skip

    def options(out: str):  # type: ignore[no-untyped-def]
        return build_options_from_mapping({"input": corpus, "tokenizer": tok, "output": out,
                                           "workers": 2, "shard_size": "1MiB"})  # fmt: skip

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    rows = []
    for engine in ("local", "ray"):
        times = []
        for r in range(args.repeats):
            out = os.path.join(work, f"{engine}-{r}")
            seconds, _ = timed(lambda o=out, e=engine: build(options(o), EngineOptions(engine=e)))
            times.append(seconds)
        rows.append((engine, min(times)))
    ray.shutdown()
    assert tree(os.path.join(work, "local-0")) == tree(os.path.join(work, "ray-0"))
    print(f"\n| build (2 CPUs) | best of {args.repeats} s | ratio |")
    print("|---|---|---|")
    for engine, seconds in rows:
        print(f"| {engine} | {seconds:.2f} | {seconds / rows[0][1]:.2f} |")

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    os.environ.update(AWS_ACCESS_KEY_ID="x", AWS_SECRET_ACCESS_KEY="x",
                      AWS_DEFAULT_REGION="us-east-1", AWS_ENDPOINT_URL=endpoint)  # fmt: skip
    boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket="bench")
    url = "s3://bench/cache"
    up, _ = timed(lambda: build(options(url)))
    local = os.path.join(work, "local-0")
    nbytes = sum(os.path.getsize(os.path.join(local, "shards", n))
                 for n in os.listdir(os.path.join(local, "shards")))  # fmt: skip
    print(f"\nbuild into s3:// (stage + upload): {up:.2f} s; shards {nbytes / 1e6:.1f} MB")
    print("\n| read pass (all sequences) | s | MB/s |")
    print("|---|---|---|")
    for name, path in (("local disk", local), ("s3 cold (download+sha256)", url),
                       ("s3 warm (local shard cache)", url)):  # fmt: skip
        seconds, _ = timed(lambda p=path: read_all(p))
        print(f"| {name} | {seconds:.2f} | {nbytes / 1e6 / seconds:.0f} |")
    for name, path in (("verify local", local), ("verify s3", url)):
        seconds, report = timed(lambda p=path: verify_cache(p))
        assert report.ok
        print(f"| {name} | {seconds:.2f} | {nbytes / 1e6 / seconds:.0f} |")
    server.stop()
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
