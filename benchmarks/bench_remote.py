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
4. Stalls (``--part stalls``): a throttling proxy on 127.0.0.1 in front of the S3 server
   (``--latency-ms`` added to every response, ``--bandwidth-mbps`` per connection) stands for
   an ordinary object store seen from a training node. A consumer that "trains"
   ``--step-ms`` per batch reads one shuffled epoch from ``s3://`` with an empty local shard
   cache, pad and pack, in-process and through 2 DataLoader workers, read-ahead off
   (``readahead=0``: on demand) and on (``--readahead`` shards): the time to the first batch
   (from constructing the dataset), the waits for the later batches as a share of their
   step time, and the longest single wait.

    PYTHONPATH=. python benchmarks/bench_remote.py --docs 20000 --files 8
    PYTHONPATH=. python benchmarks/bench_remote.py --part stalls --docs 20000 --files 8

Not collected by pytest. Needs ray (build part), s3fs, moto[server], boto3.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import shutil
import socket
import sys
import tempfile
import threading
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


class ThrottlingProxy:
    """A TCP proxy on 127.0.0.1 in front of ``target_port``: every response (the first bytes
    back after a request) waits ``latency_s``, and each connection's responses flow at most
    ``bandwidth`` bytes per second (0: unbounded). Runs an asyncio loop on its own thread."""

    def __init__(self, target_port: int, latency_s: float, bandwidth: float) -> None:
        self.target_port = target_port
        self.latency_s = latency_s
        self.bandwidth = bandwidth
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="throttling-proxy", daemon=True)

    def start(self) -> int:
        self._thread.start()
        self._ready.wait()
        return self.port

    def stop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        server = self._loop.run_until_complete(asyncio.start_server(self._handle, "127.0.0.1", 0))
        self.port = server.sockets[0].getsockname()[1]
        self._ready.set()
        self._loop.run_forever()
        server.close()

    async def _handle(self, reader, writer) -> None:  # type: ignore[no-untyped-def]
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            writer.close()
            return
        waiting = [False]  # a request went up and its response has not started

        async def upstream() -> None:
            while data := await reader.read(1 << 16):
                waiting[0] = True
                up_writer.write(data)
                await up_writer.drain()
            up_writer.close()

        async def downstream() -> None:
            while data := await up_reader.read(1 << 16):
                if waiting[0]:
                    waiting[0] = False
                    await asyncio.sleep(self.latency_s)
                if self.bandwidth:
                    await asyncio.sleep(len(data) / self.bandwidth)
                writer.write(data)
                await writer.drain()
            writer.close()

        await asyncio.gather(upstream(), downstream(), return_exceptions=True)


def consume(make_loader, step_s: float) -> dict[str, float]:  # type: ignore[no-untyped-def]
    """Read one epoch, sleeping ``step_s`` per batch (the training step); the waits."""
    start = time.perf_counter()
    loader = make_loader()
    waits: list[float] = []
    first = 0.0
    asked = start
    for n, _ in enumerate(loader):
        now = time.perf_counter()
        if n == 0:
            first = now - start
        else:
            waits.append(now - asked)
        time.sleep(step_s)
        asked = time.perf_counter()
    close = getattr(loader, "close", None)
    if close is not None:
        close()
    steps = len(waits) * step_s
    return {
        "batches": len(waits) + 1,
        "first_batch_s": first,
        "wait_s": sum(waits),
        "wait_pct_of_steps": 100 * sum(waits) / steps if steps else 0.0,
        "longest_wait_s": max(waits, default=0.0),
    }


def stalls(args: argparse.Namespace, work: str, corpus: str, tok: str) -> dict:
    """Part 4 (see the module docstring)."""
    import boto3
    import s3fs
    from torch.utils.data import DataLoader

    from shardcache import ShardDataset
    from shardcache.builder.run import build_cache
    from shardcache.config import build_options_from_mapping
    from shardcache.read.fetch.shard_readahead import ReadAheadOptions

    local = os.path.join(work, "stalls-cache")
    values = {"input": corpus, "tokenizer": tok, "output": local, "workers": 2,
              "shard_size": args.shard_size}  # fmt: skip
    build_cache(build_options_from_mapping(values))
    server_port = free_port()
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=server_port, verbose=False)
    server.start()
    os.environ.update(AWS_ACCESS_KEY_ID="x", AWS_SECRET_ACCESS_KEY="x",
                      AWS_DEFAULT_REGION="us-east-1")  # fmt: skip
    client = boto3.client("s3", endpoint_url=f"http://127.0.0.1:{server_port}")
    client.create_bucket(Bucket="stalls")
    for root, _, names in os.walk(local):
        for name in names:
            path = os.path.join(root, name)
            client.upload_file(path, "stalls", f"cache/{os.path.relpath(path, local)}")
    shards = len(os.listdir(os.path.join(local, "shards")))
    nbytes = sum(os.path.getsize(os.path.join(local, "shards", n))
                 for n in os.listdir(os.path.join(local, "shards")))  # fmt: skip
    proxy = ThrottlingProxy(server_port, args.latency_ms / 1000, args.bandwidth_mbps * 1e6)
    os.environ["AWS_ENDPOINT_URL"] = f"http://127.0.0.1:{proxy.start()}"
    print(f"\nstalls: {shards} shards, {nbytes / 1e6:.1f} MB behind a proxy adding "
          f"{args.latency_ms:.0f} ms per response, {args.bandwidth_mbps:.0f} MB/s per "
          f"connection; step {args.step_ms:.0f} ms")  # fmt: skip
    rows, figures = [], {}
    url = "s3://stalls/cache"
    for mode in ("pad", "pack"):
        pack = {"mode": "pack", "seq_len": args.seq_len, "attention": "none"}
        extra = pack if mode == "pack" else {}
        for workers in (0, 2):
            for depth in (0, args.readahead):
                run = f"{mode}-w{workers}-ra{depth}"
                os.environ["SHARDCACHE_CACHE_DIR"] = os.path.join(work, f"local-{run}")
                s3fs.S3FileSystem.clear_instance_cache()
                options = ReadAheadOptions(shards=depth, threads=args.threads)

                def make(extra=extra, workers=workers, options=options):  # type: ignore[no-untyped-def]
                    ds = ShardDataset(url, max_tokens=args.max_tokens, seed=0,
                                      readahead=options, **extra)  # fmt: skip
                    if workers == 0:
                        return ds
                    return DataLoader(ds, batch_size=None, num_workers=workers)

                got = consume(make, args.step_ms / 1000)
                figures[run] = got
                rows.append((mode, workers, depth, got))
    proxy.stop()
    server.stop()
    print("\n| mode | workers | read-ahead | batches | first batch s | wait % of steps | "
          "longest wait ms |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for mode, workers, depth, got in rows:
        print(f"| {mode} | {workers} | {depth or 'off'} | {got['batches']} | "
              f"{got['first_batch_s']:.2f} | {got['wait_pct_of_steps']:.1f} | "
              f"{1000 * got['longest_wait_s']:.0f} |")  # fmt: skip
    return {"stalls": figures, "stalls_shards": shards, "stalls_bytes": nbytes}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--part", choices=("all", "build", "stalls"), default="all")
    parser.add_argument("--docs", type=int, default=20000)
    parser.add_argument("--files", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--shard-size", default="2MiB", help="stalls: the cache's shard size")
    parser.add_argument("--latency-ms", type=float, default=50.0, help="stalls: per response")
    parser.add_argument("--bandwidth-mbps", type=float, default=40.0,
                        help="stalls: MB/s per connection (0: unbounded)")  # fmt: skip
    parser.add_argument("--step-ms", type=float, default=20.0, help="stalls: the train step")
    parser.add_argument("--max-tokens", type=int, default=16 * 2048)
    parser.add_argument("--seq-len", type=int, default=2048, help="stalls: pack rows")
    parser.add_argument("--readahead", type=int, default=16, help="stalls: shards ahead")
    parser.add_argument("--threads", type=int, default=4, help="stalls: parallel downloads")
    args = parser.parse_args()

    work = tempfile.mkdtemp(prefix="bench-remote-")
    os.environ["SHARDCACHE_CACHE_DIR"] = os.path.join(work, "local-cache")
    corpus, tok = os.path.join(work, "corpus"), make_tokenizer(os.path.join(work, "tok"))
    make_corpus(corpus, args.files, args.docs)
    size = sum(os.path.getsize(os.path.join(corpus, n)) for n in os.listdir(corpus))
    print(f"corpus: {args.files} files, {args.docs} docs, {size / 1e6:.1f} MB; "
          f"cpus {os.cpu_count()}")  # fmt: skip
    figures: dict = {"corpus_bytes": size}
    if args.part in ("all", "build"):
        figures.update(build_and_read(args, work, corpus, tok, size))
    if args.part in ("all", "stalls"):
        figures.update(stalls(args, work, corpus, tok))
    record_result("bench_remote", figures, args)
    shutil.rmtree(work, ignore_errors=True)


def build_and_read(args: argparse.Namespace, work: str, corpus: str, tok: str, size: int) -> dict:
    """Parts 1-3 (see the module docstring)."""
    import boto3
    import ray

    from shardcache import verify_cache
    from shardcache.builder.engines import EngineOptions
    from shardcache.builder.run import build
    from shardcache.config import build_options_from_mapping

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
    figures: dict = {"build_seconds": dict(rows)}
    print(f"\n| build (2 CPUs) | best of {args.repeats} s | ratio |")
    print("|---|---|---|")
    for engine, seconds in rows:
        print(f"| {engine} | {seconds:.2f} | {seconds / rows[0][1]:.2f} |")

    port = free_port()
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
    os.environ.pop("AWS_ENDPOINT_URL", None)
    return figures


if __name__ == "__main__":
    main()
