"""Canonical streams against today's global plan at scale: bytes, shards, plan memory and time.

Both sides run in the same run, interleaved; times are the best of ``--repeats``.

1. ``sim`` (no token data): a synthetic length index of N sequences (lognormal lengths,
   mean ~400 tokens, clipped to [16, 4096]; ``lengths.npy`` opened with ``mmap_mode="r"``) in
   32 input files, each file's rows sorted by bucket (edges 64, 128, ..., 4096) and cut into
   shards of at most ``--rows-per-shard`` rows of one bucket, as a build writes them. A shard's
   bytes are modelled as ``4 * tokens + 8 * rows + 4096``. For each N and world size W (streams
   C = W), one fresh process per measurement, rank 0:

   - ``first_batch_s``: from opening the index to the sample ids of the rank's first batch;
     ``peak_rss_mib`` (``ru_maxrss`` at that moment) and ``base_rss_mib`` (after imports and
     a tiny plan that loads numba's compiled kernels, outside the timing: ``warmup_s``).
     RSS counts the pages of the memory-mapped length index a process touched, which the
     kernel maps in large pieces: ``traced_peak_mib`` (tracemalloc: numpy's own allocations)
     is the plan's memory. A first round traces memory and computes the bytes below; the
     times and RSS are the best of ``--repeats`` rounds after it, without tracemalloc (the
     whole-epoch count at sizes past today's: the traced round alone, marked ``traced``).
     ``today``: ``plan_epoch`` of the whole epoch. ``own``: ``count_batches`` of the rank's own
     streams (``own_streams``: what a rank does when ranks exchange counts; the other streams'
     counts are then read from a file, standing for the exchange, inside the timing) and
     ``count_s``. ``all``: ``count_batches`` of every stream (the whole-epoch count).
   - per rank (mean and max over ranks 0, W/2, W-1): ``first100_shards`` and
     ``first100_mb``, the distinct shards and their bytes that the rank's first 100 batches
     read; ``epoch_share``, the bytes of the distinct shards its batches read in the epoch over
     ``cache bytes / W`` (1.0: exactly its share; W: the whole cache); streams only,
     ``foreign_batches``: the share of its batches from streams it does not own
     (``own_streams``), which read other ranks' shards.

   Today's plan at N = 200 M takes minutes and GBs, so today's side runs at
   ``--today-sequences`` and its time and memory above the largest are extrapolated linearly
   from the largest (marked ``extrapolated``). Its ``epoch_share`` depends on rows per rank
   over rows per shard, not on N: it is reported at the measured sizes.

2. ``shuffle``: how well an epoch's global batch order mixes, for the lead's docs. The order
   (sample ids, batch by batch) is cut into ``--slices`` time slices; per slice, the
   total-variation distance between the distribution of its sequences over ``--groups``
   groups of consecutive shards (about the input files) and that of the whole epoch, averaged
   over slices (``tv``: 0 perfect mixing, 1 each slice from other groups); and the Spearman
   correlation between a sequence's position and its sample id (``spearman``). Rows: a
   uniform permutation and the unshuffled order (references), today's global shuffle, and
   streams at W = C in ``--shuffle-worlds`` for each ``--shuffle-blocks``.

3. ``remote``: a loopback S3 server (moto's, on 127.0.0.1) holding a cache of a few hundred
   shards (built from a generated corpus, or ``--cache``); W = ``--remote-world`` rank
   processes at once, each with its own ``SHARDCACHE_CACHE_DIR`` and
   ``SHARDCACHE_CACHE_SIZE`` = a quarter of the cache's shard bytes, read one shuffled epoch,
   pad and pack, today (``streams=0``) and streams (``streams=W``). Per rank: the shard bytes
   the server sent it (GET response bodies, told apart by each rank's access key id) and the
   bytes its ``ds.stats()`` counts (``bytes_ahead + bytes_on_demand``), each over
   ``cache bytes / W``; the epoch's wall time of the W ranks together. ``--remote-sources K``
   builds K caches instead (each of every K-th corpus file) and the ranks read their mixture,
   each source weighted by its tokens (an epoch reads every document once), the share being
   all K caches' bytes over W.

    PYTHONPATH=. python benchmarks/bench_scale.py                 # all parts, ~10 minutes
    PYTHONPATH=. python benchmarks/bench_scale.py --quick         # small sizes, a smoke run
    PYTHONPATH=. python benchmarks/bench_scale.py --part sim --sequences 2M,20M,200M

The streams side needs ``shardcache.read.plan.streams`` (sim, shuffle) and ``PlanOptions.streams``
(remote); without them only today's side runs, and the output says so. Not collected by
pytest. The remote part needs s3fs, moto[server] and boto3 (``pip install -e ".[s3,remote-test]"``).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import tracemalloc
from collections import Counter
from typing import Any

import numpy as np
from results import record_result

HERE = os.path.dirname(os.path.abspath(__file__))
BUCKET_EDGES = np.array([64, 128, 256, 512, 1024, 2048, 4096], dtype=np.int64)
INPUT_FILES = 32


# --------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------


def count(text: str) -> int:
    """``2M`` -> 2_000_000 (suffixes K, M, G in thousands)."""
    text = text.strip().upper()
    scale = {"K": 10**3, "M": 10**6, "G": 10**9}.get(text[-1:], 1)
    return int(float(text[:-1] if scale > 1 else text) * scale)


def counts(text: str) -> list[int]:
    """A comma-separated list of ``count``."""
    return [count(t) for t in text.split(",") if t.strip()]


def human(n: int) -> str:
    """2_000_000 -> ``2M``."""
    for unit, scale in (("G", 10**9), ("M", 10**6), ("K", 10**3)):
        if n >= scale and n % (scale // 10) == 0:
            return f"{n / scale:g}{unit}"
    return str(n)


def rss_mib() -> float:
    """This process's peak resident memory so far."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def streams_module() -> Any:
    """``shardcache.read.plan.streams``, or None where it has not landed."""
    try:
        import shardcache.read.plan.streams as streams
    except ImportError:
        return None
    return streams


def plan_options(args: argparse.Namespace, mode: str) -> Any:
    """The batch options of a measurement (``streams`` left out: the planners take it apart)."""
    from shardcache.read.plan.epoch_plan import PlanOptions

    if mode == "pack":
        return PlanOptions(max_tokens=args.max_tokens, mode="pack", seq_len=args.seq_len,
                           packing=args.packing)  # fmt: skip
    return PlanOptions(max_tokens=args.max_tokens)


# --------------------------------------------------------------------------------------------
# The synthetic index
# --------------------------------------------------------------------------------------------


def make_index(work: str, n: int, rows_per_shard: int, seed: int = 0) -> str:
    """The folder of a synthetic index of ``n`` sequences (made once, reused by later runs)."""
    folder = os.path.join(work, f"index-{n}-{rows_per_shard}-{seed}")
    if os.path.isfile(os.path.join(folder, "shards.npz")):
        return folder
    tmp = folder + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    lengths = np.lib.format.open_memmap(os.path.join(tmp, "lengths.npy"), mode="w+",
                                        dtype=np.int32, shape=(n,))  # fmt: skip
    starts, buckets, tokens = [], [], []
    for f in range(INPUT_FILES):
        lo, hi = n * f // INPUT_FILES, n * (f + 1) // INPUT_FILES
        if hi == lo:
            continue
        rng = np.random.default_rng([seed, f])
        length = np.clip(rng.lognormal(5.5, 1.0, hi - lo), 16, 4096).astype(np.int32)
        bucket = np.searchsorted(BUCKET_EDGES, length, side="left").astype(np.int32)
        order = np.argsort(bucket, kind="stable")
        length, bucket = length[order], bucket[order]
        lengths[lo:hi] = length
        # a new shard where the bucket changes or every rows_per_shard rows of a bucket
        run = np.r_[True, bucket[1:] != bucket[:-1]]
        run_start = np.flatnonzero(run)
        position = np.arange(hi - lo) - np.repeat(run_start, np.diff(np.r_[run_start, hi - lo]))
        first = np.flatnonzero(position % rows_per_shard == 0)
        starts.append(lo + first)
        buckets.append(bucket[first])
        tokens.append(np.add.reduceat(length.astype(np.int64), first))
    lengths.flush()
    del lengths
    shard_starts = np.r_[np.concatenate(starts), n].astype(np.int64)
    shard_tokens = np.concatenate(tokens).astype(np.int64)
    rows = np.diff(shard_starts)
    np.savez(os.path.join(tmp, "shards.npz"), starts=shard_starts, tokens=shard_tokens,
             buckets=np.concatenate(buckets), bytes=4 * shard_tokens + 8 * rows + 4096)  # fmt: skip
    os.replace(tmp, folder)
    return folder


def load_index(folder: str) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """The length index (a memory map) and the shard table."""
    lengths = np.load(os.path.join(folder, "lengths.npy"), mmap_mode="r")
    with np.load(os.path.join(folder, "shards.npz")) as z:
        shards = {k: z[k] for k in z.files}
    return lengths, shards


def touched(ids: np.ndarray, shards: dict[str, np.ndarray]) -> tuple[int, int]:
    """Distinct shards holding some sample ids, and their bytes."""
    if len(ids) == 0:
        return 0, 0
    shard = np.searchsorted(shards["starts"], ids, side="right") - 1
    hit = np.bincount(shard, minlength=len(shards["bytes"])) > 0
    return int(hit.sum()), int(shards["bytes"][hit].sum())


def rank_figures(
    ids_first100: np.ndarray, ids_epoch: np.ndarray, shards: dict[str, np.ndarray], world: int
) -> dict[str, float]:
    """One rank's shards and bytes: its first 100 batches, and its epoch against its share."""
    n100, b100 = touched(ids_first100, shards)
    _, epoch = touched(ids_epoch, shards)
    share = int(shards["bytes"].sum()) / world
    return {"first100_shards": n100, "first100_mb": b100 / 1e6, "epoch_share": epoch / share}


def stream_index(found: Any) -> int:
    """The stream of ``StreamPlan.stream_of`` (an int, or ``(stream, batch in it)``)."""
    return int(found[0] if isinstance(found, tuple) else found)


def sample_ranks(world: int) -> list[int]:
    """The ranks whose bytes are reported."""
    return sorted({0, world // 2, world - 1})


# --------------------------------------------------------------------------------------------
# Part 1: one measurement in a fresh process
# --------------------------------------------------------------------------------------------


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """``measure`` subcommand: time and memory of one rank's plan to its first batch."""
    from shardcache.read.plan.epoch_plan import plan_epoch, split_epoch

    options = plan_options(args, args.mode)
    worlds = counts(args.worlds)
    # numba's compiled kernels load on first use: both sides pay it once, outside the timing
    warm = time.perf_counter()
    # (with the index's dtypes: another signature compiles again, inside the timing)
    tiny = np.random.default_rng(0).integers(16, 4096, 300_000).astype(np.int32)
    plan_epoch(tiny, np.searchsorted(BUCKET_EDGES, tiny).astype(np.int32), options)
    base = rss_mib()
    if args.memory:
        tracemalloc.start()
    start = time.perf_counter()
    lengths, shards = load_index(args.index)
    out: dict[str, Any] = {"base_rss_mib": base, "warmup_s": start - warm}
    if args.side == "today":
        buckets = np.repeat(shards["buckets"], np.diff(shards["starts"]))
        plan: Any = plan_epoch(lengths, buckets, options, 0, 0)
        mine = split_epoch(len(plan), worlds[0], 0, options.tail).for_rank(0)
        plan.batch(int(mine[0]))
    else:
        streams = streams_module()
        world = worlds[0]
        index = streams.ShardIndex(shards["starts"], shards["tokens"], shards["buckets"], lengths)
        layout = streams.StreamLayout(index, world, args.block, 0, 0, True)
        if args.side == "own":
            got = streams.count_batches(layout, options, streams.own_streams(world, 0, world))
            out["count_s"] = time.perf_counter() - start
            with np.load(args.counts) as z:  # the exchange: every other rank's counts
                exchanged = {int(k): z[k] for k in z.files}
            exchanged.update(got)
            got = exchanged
        else:
            got = streams.count_batches(layout, options)
            out["count_s"] = time.perf_counter() - start
        plan = streams.StreamPlan(layout, options, got)
        mine = split_epoch(len(plan), world, 0, options.tail).for_rank(0)
        plan.batch(int(mine[0]))
    out["first_batch_s"] = time.perf_counter() - start
    out["peak_rss_mib"] = rss_mib()
    out["global_batches"] = len(plan)
    if args.memory:
        out["traced_peak_mib"] = tracemalloc.get_traced_memory()[1] / 2**20
        tracemalloc.stop()
    if args.side == "all" and args.counts:
        np.savez(args.counts, **{str(s): c for s, c in got.items()})
    if not args.memory or args.side == "all":  # (the ranks of "all": those of "own")
        return out
    # not timed: which shards the sampled ranks read
    per_world: dict[str, Any] = {}
    if args.side == "today":
        seg_batch = np.repeat(np.arange(len(plan)), np.diff(plan.batch_offsets))
    for world in worlds:
        split = split_epoch(len(plan), world, 0, options.tail)
        rows = []
        for r in sample_ranks(world):
            batches = split.for_rank(r)
            if args.side == "today":
                chosen = np.zeros(len(plan), dtype=bool)
                chosen[batches[:100]] = True
                first100 = plan.sample_ids[chosen[seg_batch]]
                chosen[batches] = True
                epoch_ids = plan.sample_ids[chosen[seg_batch]]
            else:
                parts = [plan.batch(int(j)) for j in batches]
                first100 = np.concatenate(parts[:100] or [np.zeros(0, np.int64)])
                epoch_ids = np.concatenate(parts or [np.zeros(0, np.int64)])
            figures = rank_figures(first100, epoch_ids, shards, world)
            if args.side != "today":
                mine = set(streams.own_streams(world, r, world))
                foreign = sum(stream_index(plan.stream_of(int(j))) not in mine for j in batches)
                figures["foreign_batches"] = foreign / max(len(batches), 1)
            rows.append(figures)
        per_world[str(world)] = {
            key: {"mean": float(np.mean([r[key] for r in rows])),
                  "max": float(np.max([r[key] for r in rows]))}
            for key in rows[0]
        }  # fmt: skip
        per_world[str(world)]["batches_per_rank"] = split.batches_per_rank
    out["ranks"] = per_world
    return out


def run_measure(args: argparse.Namespace, **extra: Any) -> dict[str, Any]:
    """One ``measure`` in a fresh interpreter; its JSON."""
    argv = [sys.executable, os.path.abspath(__file__), "measure", "--mode", args.mode,
            "--max-tokens", str(args.max_tokens), "--seq-len", str(args.seq_len),
            "--packing", args.packing, "--block", str(args.block)]  # fmt: skip
    for key, value in extra.items():
        if value is True:
            argv.append(f"--{key.replace('_', '-')}")
        elif value not in (None, False):
            argv += [f"--{key.replace('_', '-')}", str(value)]
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def best(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Times and RSS: the least of the timed rounds; tracemalloc and bytes: the memory round."""
    timed = runs[1:] or runs
    top = dict(min(timed, key=lambda r: r["first_batch_s"]))
    top["timed_rounds"] = len(runs) - 1  # 0: the time is of the traced round
    top["peak_rss_mib"] = min(r["peak_rss_mib"] for r in timed)
    if "count_s" in top:
        top["count_s"] = min(r["count_s"] for r in timed)
    for key in ("traced_peak_mib", "ranks"):
        if key in runs[0]:
            top[key] = runs[0][key]
    return top


def simulate(args: argparse.Namespace, work: str) -> dict[str, Any]:
    """Part 1 (see the module docstring)."""
    sizes, today_sizes, worlds = (
        counts(args.sequences),
        counts(args.today_sequences),
        counts(args.worlds),
    )
    have_streams = streams_module() is not None
    if not have_streams:
        print("sim: shardcache.read.plan.streams is not importable here: today's side only")
    made: dict[int, str] = {}
    for n in sorted(set(sizes) | set(today_sizes)):
        start = time.perf_counter()
        made[n] = make_index(work, n, args.rows_per_shard)
        _, shards = load_index(made[n])
        print(f"index {human(n)}: {len(shards['bytes'])} shards, "
              f"{shards['bytes'].sum() / 1e9:.2f} GB modelled, "
              f"{time.perf_counter() - start:.1f} s")  # fmt: skip
    # round 0 measures memory (tracemalloc on) and the ranks' bytes; rounds 1.. the times
    runs: dict[tuple[str, int, int], list[dict[str, Any]]] = {}
    largest = max(today_sizes)
    for rep in range(args.repeats + 1):
        memory = rep == 0
        for n in sorted(set(sizes) | set(today_sizes)):
            if n in today_sizes:
                got = run_measure(args, side="today", index=made[n], worlds=args.worlds,
                                  memory=memory)  # fmt: skip
                runs.setdefault(("today", n, 0), []).append(got)
                print(f"  today {human(n)}: {got['first_batch_s']:.2f} s", flush=True)
            if not have_streams or n not in sizes:
                continue
            for world in worlds:
                counts_file = os.path.join(work, f"counts-{n}-{world}-{args.mode}.npz")
                for side in ("all", "own"):
                    if side == "all" and n > largest and rep > 0:
                        continue  # the whole-epoch count past today's sizes: one traced run
                    got = run_measure(args, side=side, index=made[n], worlds=str(world),
                                      counts=counts_file, memory=memory)  # fmt: skip
                    runs.setdefault((side, n, world), []).append(got)
                    print(f"  {side} {human(n)} W={world}: {got['first_batch_s']:.2f} s",
                          flush=True)  # fmt: skip
    figures: dict[str, Any] = {}
    for (side, n, world), got in runs.items():
        figures[f"{side}-{human(n)}" + (f"-W{world}" if world else "")] = best(got)
    # today's side above its largest measured size: linear in N from the largest
    ref = figures[f"today-{human(largest)}"]
    for n in sizes:
        if n > largest:
            k, base = n / largest, ref["base_rss_mib"]
            figures[f"today-{human(n)}"] = {
                "extrapolated": True,
                "first_batch_s": ref["first_batch_s"] * k,
                "peak_rss_mib": base + (ref["peak_rss_mib"] - base) * k,
                "base_rss_mib": base,
                "traced_peak_mib": ref.get("traced_peak_mib", 0.0) * k,
                "ranks": ref["ranks"],
            }
    print(f"\nsim ({args.mode}, max_tokens {args.max_tokens}, shuffle_block {args.block}, "
          f"{args.rows_per_shard} rows a shard; times best of {args.repeats}; per rank: mean/max "
          f"over ranks 0, W/2, W-1)")  # fmt: skip
    print("\n| N | W | side | first batch s | count s | peak RSS MiB (base) | numpy peak MiB "
          "| first 100: shards "
          "| first 100: MB | epoch bytes / (cache/W) | foreign batches |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for n in sorted(set(sizes) | set(today_sizes)):
        for world in worlds:
            for side in ("today", "own", "all"):
                key = f"{side}-{human(n)}" + ("" if side == "today" else f"-W{world}")
                top = figures.get(key)
                if top is None:
                    continue
                ranks = (top.get("ranks") or {}).get(str(world))
                if ranks is None and side == "all":
                    own = figures.get(f"own-{human(n)}-W{world}", {})
                    ranks = (own.get("ranks") or {}).get(str(world))  # the same plan
                cells = ["-"] * 4
                if ranks:
                    cells = [f"{ranks[k]['mean']:.1f} / {ranks[k]['max']:.1f}"
                             for k in ("first100_shards", "first100_mb")]  # fmt: skip
                    cells += [f"{ranks[k]['mean']:.2f} / {ranks[k]['max']:.2f}" if k in ranks
                              else "-" for k in ("epoch_share", "foreign_batches")]  # fmt: skip
                mark = " (extrapolated)" if top.get("extrapolated") else ""
                if top.get("timed_rounds") == 0:
                    mark = " (traced)"
                count_s = f"{top['count_s']:.2f}" if "count_s" in top else "-"
                traced = f"{top['traced_peak_mib']:.0f}" if "traced_peak_mib" in top else "-"
                rss = f"{top['peak_rss_mib']:.0f} ({top['base_rss_mib']:.0f})"
                print(f"| {human(n)} | {world} | {side}{mark} | {top['first_batch_s']:.2f} | "
                      f"{count_s} | {rss} | {traced} | " + " | ".join(cells) + " |")  # fmt: skip
    return {"sim": figures, "sim_streams": have_streams}


# --------------------------------------------------------------------------------------------
# Part 2: shuffle quality
# --------------------------------------------------------------------------------------------


def shuffle_quality(
    order: np.ndarray, shard_starts: np.ndarray, groups: int = 32, slices: int = 20
) -> dict[str, float]:
    """The library's measure of how an epoch's order mixes (``streams.order_mixing``)."""
    from shardcache.read.plan.streams import order_mixing

    return order_mixing(order, shard_starts, groups, slices)


def shuffle(args: argparse.Namespace, work: str) -> dict[str, Any]:
    """Part 2 (see the module docstring)."""
    from shardcache.read.plan.epoch_plan import plan_epoch

    n = count(args.shuffle_sequences)
    lengths, shards = load_index(make_index(work, n, args.rows_per_shard))
    options = plan_options(args, args.mode)
    starts = shards["starts"]
    rows: list[tuple[str, dict[str, float]]] = []

    def quality(order: np.ndarray) -> dict[str, float]:
        return shuffle_quality(order, starts, args.groups, args.slices)

    rows.append(("uniform permutation", quality(np.random.default_rng(1).permutation(n))))
    rows.append(("unshuffled (cache order)", quality(np.arange(n))))
    buckets = np.repeat(shards["buckets"], np.diff(starts))
    rows.append(
        ("today (global shuffle)", quality(plan_epoch(lengths, buckets, options).sample_ids))
    )
    streams = streams_module()
    if streams is None:
        print("shuffle: shardcache.read.plan.streams is not importable here: today's side only")
    else:
        index = streams.ShardIndex(starts, shards["tokens"], shards["buckets"], lengths)
        for world in counts(args.shuffle_worlds):
            for block in counts(args.shuffle_blocks):
                layout = streams.StreamLayout(index, world, block, 0, 0, True)
                plan = streams.StreamPlan(layout, options)
                order = np.concatenate([plan.batch(j) for j in range(len(plan))])
                rows.append((f"streams C=W={world}, shuffle_block 2**{block.bit_length() - 1}",
                             quality(order)))  # fmt: skip
    print(f"\nshuffle quality ({human(n)} sequences, {len(starts) - 1} shards in {args.groups} "
          f"groups, {args.slices} slices, {args.mode})")  # fmt: skip
    print("\n| order | TV mean | TV max | Spearman |")
    print("|---|---|---|---|")
    for name, q in rows:
        print(f"| {name} | {q['tv']:.3f} | {q['tv_max']:.3f} | {q['spearman']:+.4f} |")
    return {"shuffle": dict(rows), "shuffle_sequences": n}


# --------------------------------------------------------------------------------------------
# Part 3: ranks reading one epoch from a loopback S3 server
# --------------------------------------------------------------------------------------------


class _ShardReads:
    """WSGI middleware: the response bytes of shard GETs, per access key id (one per rank)."""

    KEY = re.compile(r"Credential=([^/]+)/")

    def __init__(self, app: Any) -> None:
        self.app = app
        self.bytes: Counter[str] = Counter()
        self.requests: Counter[str] = Counter()
        self.lock = threading.Lock()

    def __call__(self, environ: dict[str, Any], start_response: Any) -> Any:
        body = self.app(environ, start_response)
        if environ.get("REQUEST_METHOD") != "GET" or "/shards/" not in environ.get("PATH_INFO", ""):
            return body
        found = self.KEY.search(environ.get("HTTP_AUTHORIZATION", ""))
        who = found.group(1) if found else "?"

        def counted() -> Any:
            sent = 0
            try:
                for chunk in body:
                    sent += len(chunk)
                    yield chunk
            finally:
                close = getattr(body, "close", None)
                if close is not None:
                    close()
                with self.lock:
                    self.bytes[who] += sent
                    self.requests[who] += 1

        return counted()


def counting_server(port: int) -> Any:
    """moto's threaded server with ``_ShardReads`` around its app."""
    from moto.moto_server.threaded_moto_server import ThreadedMotoServer
    from moto.server import DomainDispatcherApplication, create_backend_app
    from werkzeug.serving import make_server

    class Server(ThreadedMotoServer):
        reads = _ShardReads(DomainDispatcherApplication(create_backend_app))

        def _server_entry(self) -> None:
            self._server = make_server(self._ip_address, self._port, self.reads, True)
            self._server_ready_event.set()
            self._server.serve_forever()

    return Server(ip_address="127.0.0.1", port=port, verbose=False)


def free_port() -> int:
    """A free TCP port on 127.0.0.1."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rank_main(args: argparse.Namespace) -> dict[str, Any]:
    """``rank`` subcommand: one rank reads one epoch from ``args.url``; its figures."""
    from shardcache import ShardDataset

    extra: dict[str, Any] = {}
    if args.mode == "pack":
        extra = {"mode": "pack", "seq_len": args.seq_len, "attention": "none"}
    if args.streams is not None:
        extra.update(streams=args.streams, shuffle_block=args.block)
    start = time.perf_counter()
    batches = tokens = 0
    urls = args.url.split(",")
    path: Any = urls[0]
    if len(urls) > 1:  # a mixture, each source at its share of the tokens: every document once
        from shardcache import Source

        weights = [float(w) for w in args.weights.split(",")]
        path = [Source(u, weight=w, max_repetitions=1.01, name=f"s{i}")
                for i, (u, w) in enumerate(zip(urls, weights))]  # fmt: skip
    with ShardDataset(path, max_tokens=args.max_tokens, seed=0, rank=args.rank,
                      world_size=args.world, **extra) as ds:  # fmt: skip
        for batch in ds:
            batches += 1
            tokens += int(batch["input_ids"].numel())
        stats = ds.stats()
    return {"batches": batches, "slots": tokens, "seconds": time.perf_counter() - start,
            "stats": stats}  # fmt: skip


def build_remote_cache(args: argparse.Namespace, work: str) -> list[str]:
    """Local caches of a few hundred shards in all from a generated corpus (or ``--cache``).

    ``--remote-sources`` caches, each of every ``k``-th corpus file (one: all of them).
    """
    if args.cache:
        return [str(args.cache)]
    sys.path.insert(0, os.path.join(HERE, "..", "tests"))
    from conftest import _save_bpe, make_texts, write_records
    from shardcache.builder.run import build_cache
    from shardcache.config import build_options_from_mapping

    corpus = os.path.join(work, "corpus")
    os.makedirs(corpus)
    files = 8
    for f in range(files):
        texts = make_texts(args.remote_docs // files, seed=f, max_words=400)
        write_records(os.path.join(corpus, f"part-{f:03d}.jsonl"), [{"text": t} for t in texts],
                      "jsonl")  # fmt: skip
    tok = _save_bpe(os.path.join(work, "tok"), make_texts(2000, seed=7), vocab_size=2000,
                    bos=False)  # fmt: skip
    k = max(1, args.remote_sources)
    outs = []
    for i in range(k):
        inputs = [os.path.join(corpus, f"part-{f:03d}.jsonl") for f in range(i, files, k)]
        out = os.path.join(work, f"remote-cache{i}")
        build_cache(build_options_from_mapping({"input": inputs, "tokenizer": tok, "output": out,
                                                "workers": 2, "max_length": args.seq_len,
                                                "truncation": "split",
                                                "shard_size": args.remote_shard_size}))  # fmt: skip
        outs.append(out)
    return outs


def remote(args: argparse.Namespace, work: str) -> dict[str, Any]:
    """Part 3 (see the module docstring)."""
    import boto3

    from shardcache import open_cache
    from shardcache.read.plan.epoch_plan import PlanOptions

    locals_ = build_remote_cache(args, work)
    shard_bytes = num_shards = 0
    weights = []
    for local in locals_:
        cache = open_cache(local)
        shard_bytes += sum(int(s["bytes"]) for s in cache.shards)
        num_shards += len(cache.shards)
        weights.append(str(int(np.sum(cache.lengths, dtype=np.int64))))
        cache.close()
    world = args.remote_world
    share = shard_bytes / world
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    port = free_port()
    server = counting_server(port)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    env = dict(os.environ, AWS_SECRET_ACCESS_KEY="x", AWS_DEFAULT_REGION="us-east-1",
               AWS_ENDPOINT_URL=endpoint, SHARDCACHE_CACHE_SIZE=str(shard_bytes // 4))  # fmt: skip
    client = boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="upload",
                          aws_secret_access_key="x", region_name="us-east-1")  # fmt: skip
    client.create_bucket(Bucket="bench")
    for i, local in enumerate(locals_):
        for root, _, names in os.walk(local):
            for name in names:
                path = os.path.join(root, name)
                client.upload_file(path, "bench", f"cache{i}/{os.path.relpath(path, local)}")
    url = ",".join(f"s3://bench/cache{i}" for i in range(len(locals_)))
    has_streams = "streams" in PlanOptions.__dataclass_fields__
    sides: list[tuple[str, int | None]] = [("today", 0 if has_streams else None)]
    if has_streams:
        sides.append(("streams", world))
    else:
        print("remote: PlanOptions has no streams field in this shardcache: today's side only")
    print(f"\nremote: {len(locals_)} source(s), {num_shards} shards, {shard_bytes / 1e6:.1f} MB; "
          f"W={world} rank processes "
          f"at once, SHARDCACHE_CACHE_SIZE={shard_bytes // 4} bytes each")  # fmt: skip
    figures: dict[str, Any] = {"shards": num_shards, "shard_bytes": shard_bytes, "world": world,
                               "sources": len(locals_)}  # fmt: skip
    table = []
    for rep in range(args.remote_repeats):
        for mode in ("pad", "pack"):
            for side, streams in sides:
                run = f"{side}-{mode}"
                procs = []
                start = time.perf_counter()
                for r in range(world):
                    argv = [sys.executable, os.path.abspath(__file__), "rank", "--url", url,
                            "--rank", str(r), "--world", str(world), "--mode", mode,
                            "--max-tokens", str(args.remote_max_tokens),
                            "--seq-len", str(args.seq_len), "--block", str(args.block),
                            "--weights", ",".join(weights)]  # fmt: skip
                    if streams is not None:
                        argv += ["--streams", str(streams)]
                    key = f"{side}{mode}{rep}r{r}"
                    local_dir = os.path.join(work, "local", key)
                    rank_env = dict(env, AWS_ACCESS_KEY_ID=key, SHARDCACHE_CACHE_DIR=local_dir)
                    pipe = subprocess.PIPE
                    proc = subprocess.Popen(argv, env=rank_env, stdout=pipe, stderr=pipe, text=True)
                    procs.append((key, proc))
                ranks = []
                for key, proc in procs:
                    out, err = proc.communicate()
                    if proc.returncode != 0:
                        raise RuntimeError(f"rank {key} failed:\n{err[-4000:]}")
                    got = json.loads(out.strip().splitlines()[-1])
                    got["server_bytes"] = server.reads.bytes[key]
                    got["server_gets"] = server.reads.requests[key]
                    ranks.append(got)
                wall = time.perf_counter() - start
                served = [g["server_bytes"] / share for g in ranks]
                counted = [(g["stats"]["bytes_ahead"] + g["stats"]["bytes_on_demand"]) / share
                           for g in ranks]  # fmt: skip
                row = {
                    "wall_s": wall,
                    "batches_per_rank": ranks[0]["batches"],
                    "server_share_mean": float(np.mean(served)),
                    "server_share_max": float(np.max(served)),
                    "stats_share_mean": float(np.mean(counted)),
                    "stats_share_max": float(np.max(counted)),
                    "gets_per_rank": float(np.mean([g["server_gets"] for g in ranks])),
                }
                old = figures.get(run)
                if old is None or wall < old["wall_s"]:
                    figures[run] = row
                print(f"  {run}: {wall:.1f} s, served/share {row['server_share_mean']:.2f}",
                      flush=True)  # fmt: skip
    server.stop()
    for mode in ("pad", "pack"):
        for side, _ in sides:
            table.append((f"{side}-{mode}", figures[f"{side}-{mode}"]))
    print(
        f"\n| W={world} | batches/rank | served bytes / (cache/W) mean, max | ds.stats() bytes "
        f"/ (cache/W) mean, max | GETs/rank | epoch wall s (best of {args.remote_repeats}) |"
    )
    print("|---|---|---|---|---|---|")
    for name, row in table:
        print(f"| {name} | {row['batches_per_rank']} | {row['server_share_mean']:.2f}, "
              f"{row['server_share_max']:.2f} | {row['stats_share_mean']:.2f}, "
              f"{row['stats_share_max']:.2f} | {row['gets_per_rank']:.0f} | "
              f"{row['wall_s']:.1f} |")  # fmt: skip
    return {"remote": figures}


# --------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------

QUICK = {"sequences": "200K,1M", "today_sequences": "200K,1M", "worlds": "8,64", "repeats": 1,
         "shuffle_sequences": "400K", "shuffle_worlds": "8,64", "remote_docs": 6000,
         "remote_shard_size": "4KiB", "remote_repeats": 1}  # fmt: skip


def parser() -> argparse.ArgumentParser:
    """The options (a few are for the ``measure`` and ``rank`` subprocesses only)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("command", nargs="?", default="run", choices=("run", "measure", "rank"),
                   help=argparse.SUPPRESS)  # fmt: skip
    p.add_argument("--part", default="all", choices=("all", "sim", "shuffle", "remote"))
    p.add_argument("--quick", action="store_true", help="small sizes: a smoke run")
    p.add_argument(
        "--work",
        default=os.path.join(tempfile.gettempdir(), "shardcache-bench-scale"),
        help="where the synthetic indexes are kept between runs (200 M: 0.8 GB)",
    )
    p.add_argument("--sequences", default="2M,20M,200M", help="sim: sizes of the streams side")
    p.add_argument("--today-sequences", default="2M,20M,40M", help="sim: today's side")
    p.add_argument("--worlds", default="64,1024", help="sim: world sizes (streams C = W)")
    p.add_argument("--rows-per-shard", type=int, default=1000)
    p.add_argument("--repeats", type=int, default=3, help="sim: best of")
    p.add_argument("--mode", default="pad", choices=("pad", "pack"), help="sim, shuffle")
    p.add_argument("--packing", default="concat", choices=("best_fit", "concat"))
    p.add_argument("--max-tokens", type=int, default=16 * 4096)
    p.add_argument("--seq-len", type=int, default=4096, help="pack rows (remote: max length)")
    p.add_argument("--block", type=int, default=1 << 18, help="shuffle_block of the streams")
    p.add_argument("--shuffle-sequences", default="4M")
    p.add_argument("--shuffle-worlds", default="8,64")
    p.add_argument("--shuffle-blocks", default=f"{2**14},{2**16},{2**18}")
    p.add_argument("--groups", type=int, default=32, help="shuffle: groups of shards")
    p.add_argument("--slices", type=int, default=20, help="shuffle: time slices")
    p.add_argument("--cache", default=None, help="remote: a local cache to upload")
    p.add_argument("--remote-docs", type=int, default=20000)
    p.add_argument("--remote-shard-size", default="8KiB")
    p.add_argument("--remote-world", type=int, default=8)
    p.add_argument("--remote-max-tokens", type=int, default=8 * 1024)
    p.add_argument("--remote-repeats", type=int, default=1)
    p.add_argument(
        "--remote-sources",
        type=int,
        default=1,
        help="remote: a mixture of this many caches (each source at its share)",
    )
    p.add_argument("--weights", help=argparse.SUPPRESS)
    # subprocesses
    p.add_argument("--side", choices=("today", "own", "all"), help=argparse.SUPPRESS)
    p.add_argument("--index", help=argparse.SUPPRESS)
    p.add_argument("--counts", help=argparse.SUPPRESS)
    p.add_argument("--memory", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--url", help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    p.add_argument("--world", type=int, help=argparse.SUPPRESS)
    p.add_argument("--streams", type=int, default=None, help=argparse.SUPPRESS)
    return p


def main() -> None:
    """Run the parts, print their tables, record one result line."""
    p = parser()
    args = p.parse_args()
    if args.command == "measure":
        print(json.dumps(measure(args)))
        return
    if args.command == "rank":
        print(json.dumps(rank_main(args), default=str))
        return
    if args.quick:
        p.set_defaults(**QUICK)
        args = p.parse_args()
        args.remote_max_tokens = min(args.remote_max_tokens, 4096)
        args.seq_len = min(args.seq_len, 1024)
    work = args.work
    os.makedirs(work, exist_ok=True)
    figures: dict[str, Any] = {}
    if args.part in ("all", "sim"):
        figures.update(simulate(args, work))
    if args.part in ("all", "shuffle"):
        figures.update(shuffle(args, work))
    if args.part in ("all", "remote"):
        remote_work = tempfile.mkdtemp(prefix="remote-", dir=work)
        try:
            figures.update(remote(args, remote_work))
        finally:
            shutil.rmtree(remote_work, ignore_errors=True)
    figures["streams_module"] = streams_module() is not None
    record_result("bench_scale", figures, {k: v for k, v in vars(args).items()
                                           if k not in ("command", "side", "index", "counts",
                                                        "memory", "url", "rank", "world",
                                                        "streams", "weights")})  # fmt: skip


if __name__ == "__main__":
    main()
