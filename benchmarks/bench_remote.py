"""Distributed build and object storage: what they cost against the local paths.

1. Build overhead of the Ray engine: a local Ray cluster with 2 CPUs (``ray.init(num_cpus=2)``,
   started before timing) against the local process pool with 2 workers, same corpus and
   options; both outputs are checked byte-identical.
2. A build into a loopback S3 server (partition tasks upload their own files, the driver
   commits from the records in the store): its time, and the bytes uploaded (counted by the
   server: request bodies of PUT/POST) against the size of the cache (each byte once: ~1.00;
   the rest is records, plan and manifest).
3. Read throughput from a loopback S3 server (moto's standalone server on 127.0.0.1) against
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

from results import record_result

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


class _Uploads:
    """WSGI middleware: the body bytes of every PUT/POST (decoded length for aws-chunked)."""

    def __init__(self, app):  # type: ignore[no-untyped-def]
        self.app = app
        self.bytes = 0
        self.requests = 0

    def __call__(self, environ, start_response):  # type: ignore[no-untyped-def]
        if environ.get("REQUEST_METHOD") in ("PUT", "POST"):
            length = environ.get("HTTP_X_AMZ_DECODED_CONTENT_LENGTH") or environ.get(
                "CONTENT_LENGTH"
            )
            self.bytes += int(length or 0)
            self.requests += 1
        return self.app(environ, start_response)


def counting_server(port: int):  # type: ignore[no-untyped-def]
    """moto's threaded server with :class:`_Uploads` around its app."""
    from moto.moto_server.threaded_moto_server import ThreadedMotoServer
    from moto.server import DomainDispatcherApplication, create_backend_app
    from werkzeug.serving import make_server

    class Server(ThreadedMotoServer):
        uploads = _Uploads(DomainDispatcherApplication(create_backend_app))

        def _server_entry(self) -> None:
            self._server = make_server(self._ip_address, self._port, self.uploads, True)
            self._server_ready_event.set()
            self._server.serve_forever()

    return Server(ip_address="127.0.0.1", port=port, verbose=False)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--docs", type=int, default=20000)
    parser.add_argument("--files", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()

    import boto3
    import ray

    from shardcache import verify_cache
    from shardcache.builder.engines import EngineOptions
    from shardcache.builder.run import build
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
    figures: dict = {"corpus_bytes": size, "build_seconds": dict(rows)}
    print(f"\n| build (2 CPUs) | best of {args.repeats} s | ratio |")
    print("|---|---|---|")
    for engine, seconds in rows:
        print(f"| {engine} | {seconds:.2f} | {seconds / rows[0][1]:.2f} |")

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = counting_server(port)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    os.environ.update(AWS_ACCESS_KEY_ID="x", AWS_SECRET_ACCESS_KEY="x",
                      AWS_DEFAULT_REGION="us-east-1", AWS_ENDPOINT_URL=endpoint)  # fmt: skip
    client = boto3.client("s3", endpoint_url=endpoint)
    client.create_bucket(Bucket="bench")
    url = "s3://bench/cache"
    server.uploads.bytes = server.uploads.requests = 0
    up, _ = timed(lambda: build(options(url)))
    uploaded, puts = server.uploads.bytes, server.uploads.requests
    local = os.path.join(work, "local-0")
    nbytes = sum(os.path.getsize(os.path.join(local, "shards", n))
                 for n in os.listdir(os.path.join(local, "shards")))  # fmt: skip
    stored = sum(o["Size"] for o in client.list_objects_v2(Bucket="bench")["Contents"])
    figures.update(s3_build_seconds=up, s3_stored_bytes=stored, s3_uploaded_bytes=uploaded)
    print(f"\nbuild into s3:// (tasks upload, commit from records): {up:.2f} s")
    print("\n| bytes | MB | / cache |")
    print("|---|---|---|")
    for name, value in (("cache in the store (all objects)", stored),
                        (f"uploaded ({puts} PUT/POST requests)", uploaded),
                        ("shards alone", nbytes)):  # fmt: skip
        print(f"| {name} | {value / 1e6:.2f} | {value / stored:.2f} |")
    print("\n| read pass (all sequences) | s | MB/s |")
    print("|---|---|---|")
    for name, path in (("local disk", local), ("s3 cold (download+sha256)", url),
                       ("s3 warm (local shard cache)", url)):  # fmt: skip
        seconds, _ = timed(lambda p=path: read_all(p))
        figures[f"read {name} seconds"] = seconds
        print(f"| {name} | {seconds:.2f} | {nbytes / 1e6 / seconds:.0f} |")
    for name, path in (("verify local", local), ("verify s3", url)):
        seconds, report = timed(lambda p=path: verify_cache(p))
        assert report.ok
        figures[f"{name} seconds"] = seconds
        print(f"| {name} | {seconds:.2f} | {nbytes / 1e6 / seconds:.0f} |")
    server.stop()
    record_result("bench_remote", figures, args)
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
