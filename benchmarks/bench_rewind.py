"""Rewind's seek at scale: the batch of step 10**6 of a 200 M-sequence cache at W = 1,024.

Goal (issue 56): seeking to step ``--step`` of a run over an N-sequence cache at world size W
(streams C = W) takes <= 2 s and reads no shard the batch does not use.

1. ``sim``: ``bench_scale.py``'s synthetic length index (lognormal lengths, bucket-pure shards
   of at most ``--rows-per-shard`` rows; ``lengths.npy`` memory-mapped). The run's record is
   what a reader's state holds after ``--step`` steps of W ranks with accumulation
   ``--grad-accum``: a segment from step 0, every epoch's global batch count and, the epochs
   being whole stream rounds, its stream length ``M`` (``RunRecord.epoch_rounds``). Setup
   (not timed, kept in ``--work``): every stream of epoch 0 is counted (``count_batches``,
   what the run's readers did); the epochs the step passes are given epoch 0's count (only
   the epoch walk adds them); the epoch the step lands in is counted for real, so its ``M``
   and its cuts are its own. Each measurement is one fresh process, rank ``--rank``:

   - ``seek_s``: from reading the record file to the batch's sample ids: the step's epoch and
     global batch by arithmetic over the recorded counts (``run_record.batch_of_micro``), the
     epoch's ``StreamLayout``, and ``streams.seek_batch``: the batch's stream counted, its one
     block planned (what ``ShardDataset.locate_batch`` does for ``Rewinder``); best of
     ``--repeats`` processes. numba's kernels load before the clock (``warmup_s``), as a
     rewind process pays once.
   - ``traced_peak_mib``: tracemalloc's peak over the seek (a separate, first process).
   - ``batch_shards``: the distinct shards holding the located batch's sample ids; the seek
     itself reads no shard (only the length index: ``index_rows_read`` rows, all in the
     batch's stream and the stream bounds' shards), so a rewind reads the batch's shards and
     no other. ``check``: the located batch equals ``StreamPlan``'s (every stream's counts,
     the setup's) batch of that index.

2. ``real``: the same path end to end on a real cache (``tests/read/data/matrix/text_a``, C = W =
   ``--real-world``): a record with ``epoch_rounds`` after ``--real-epochs`` epochs, then
   ``Rewinder.step`` for every rank and micro-batch of ``--real-steps`` steps; the shards the
   cache opened (``ShardCache.get``) against the shards of the batches' sample ids.

    PYTHONPATH=. python benchmarks/bench_rewind.py                            # 20M,60M,200M
    PYTHONPATH=. python benchmarks/bench_rewind.py --sequences 2M --repeats 1 # a smoke run

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
import time
import tracemalloc
from typing import Any

import numpy as np
from bench_scale import BUCKET_EDGES, count, counts, human, load_index, make_index, touched
from results import record_result

HERE = os.path.dirname(os.path.abspath(__file__))
SEED = 0


def options(args: argparse.Namespace) -> Any:
    """The batch options of the simulated run (``streams`` = W, as the reader resolves it)."""
    from shardcache.read.plan.epoch_plan import PlanOptions

    if args.mode == "pack":
        return PlanOptions(max_tokens=args.max_tokens, mode="pack", seq_len=args.seq_len,
                           packing=args.packing, streams=args.world,
                           shuffle_block=args.block)  # fmt: skip
    return PlanOptions(max_tokens=args.max_tokens, streams=args.world, shuffle_block=args.block)


def layout_of(folder: str, args: argparse.Namespace, epoch: int, lengths: Any = None) -> Any:
    """An epoch's streams over the synthetic index (``lengths``: in place of the memory map)."""
    from shardcache.read.plan.streams import ShardIndex, StreamLayout

    mapped, shards = load_index(folder)
    index = ShardIndex(shards["starts"], shards["tokens"], shards["buckets"],
                       mapped if lengths is None else lengths)  # fmt: skip
    return StreamLayout(index, args.world, args.block, SEED, epoch, True)


def epoch_counts(folder: str, args: argparse.Namespace, epoch: int, work: str) -> dict[str, int]:
    """One epoch's global batches, whole rounds and longest stream (every stream counted once)."""
    from shardcache.read.plan.streams import StreamPlan, count_batches

    name = f"rewind-{os.path.basename(folder)}-W{args.world}-{args.mode}-{args.block}-e{epoch}"
    path = os.path.join(work, name + ".json")
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    layout = layout_of(folder, args, epoch)
    start = time.perf_counter()
    plan = StreamPlan(layout, options(args), count_batches(layout, options(args)))
    got = {"batches": len(plan), "full": plan.full, "longest": int(plan.stream_batches.max()),
           "count_s": time.perf_counter() - start}  # fmt: skip
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        json.dump(got, f)
    os.replace(path + ".tmp", path)
    return got


def write_record(folder: str, args: argparse.Namespace, work: str) -> tuple[str, dict[str, Any]]:
    """The simulated run's record at ``--step`` (see the module docstring), and its setup."""
    from shardcache.read.run_record import RunRecord, Segment

    first = epoch_counts(folder, args, 0, work)
    per_rank = first["longest"]  # (C = W, whole rounds: M batches a rank and epoch)
    if first["batches"] != first["full"]:
        raise SystemExit(f"{folder}: epoch 0 is not whole stream rounds; pick another size")
    micro = args.step * args.grad_accum
    epoch = micro // per_rank
    while True:  # the landing epoch counted for real (the walk may pass into the next)
        landing = epoch_counts(folder, args, epoch, work)
        if micro - epoch * per_rank < landing["longest"] or epoch == 0:
            break
        epoch += 1
    batches = {e: first["batches"] for e in range(epoch)}
    rounds = {e: first["longest"] for e in range(epoch)}
    batches[epoch] = landing["batches"]
    if landing["batches"] == landing["full"]:
        rounds[epoch] = landing["longest"]
    segment = Segment(0, 0, 0, 0, args.world, args.grad_accum)
    plan = options(args).to_json()
    spec = {"mixture": False, "sources": [{"path": folder, "digest": "sim"}], "split": None,
            "transform": None}  # fmt: skip
    record = RunRecord(spec, "sim", SEED, plan, (segment,), (), batches, rounds)
    path = os.path.join(work, f"rewind-record-{os.path.basename(folder)}-W{args.world}.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(record.to_json(), f)
    setup = {"epoch": epoch, "epoch0_batches": first["batches"],
             "landing_batches": landing["batches"], "landing_whole_rounds":
             landing["batches"] == landing["full"], "count_s": landing["count_s"]}  # fmt: skip
    return path, setup


class ReadRows:
    """The length index, counting the rows a seek reads of it."""

    def __init__(self, lengths: np.ndarray) -> None:
        self.lengths, self.rows = lengths, 0
        self.read = np.zeros(len(lengths), dtype=bool)

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, key: Any) -> Any:
        self.read[key] = True
        return self.lengths[key]


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """``measure`` subcommand: one seek in this process (its figures as JSON)."""
    from shardcache.read.plan.epoch_plan import plan_epoch
    from shardcache.read.plan.streams import seek_batch
    from shardcache.read.run_record import batch_of_micro, micro_index, read_run_record

    warm = time.perf_counter()
    tiny = np.random.default_rng(0).integers(16, 4096, 300_000).astype(np.int32)
    plan_epoch(tiny, np.searchsorted(BUCKET_EDGES, tiny).astype(np.int32), options(args))
    out: dict[str, Any] = {"warmup_s": time.perf_counter() - warm}
    counting = None
    if args.memory:
        counting = ReadRows(load_index(args.index)[0])
        tracemalloc.start()
    start = time.perf_counter()
    record = read_run_record(args.record)
    segment = record.segment_of(args.step)
    micro = micro_index(segment, args.step, args.micro)
    epoch, index, _ = batch_of_micro(
        segment, micro, args.rank, record.epoch_batches.__getitem__, record.tail
    )
    rounds = record.epoch_rounds[epoch]
    layout = layout_of(args.index, args, epoch, counting)
    stream, k = index % layout.streams, index // layout.streams
    part, place = seek_batch(layout, options(args), stream, k, rounds)
    ids = np.asarray(part.batch(place))
    out["seek_s"] = time.perf_counter() - start
    if args.memory:
        out["traced_peak_mib"] = tracemalloc.get_traced_memory()[1] / 2**20
        tracemalloc.stop()
    _, shards = load_index(args.index)
    out.update(epoch=epoch, global_batch=index, stream=stream, stream_batch=k,
               batch_sequences=len(ids), batch_shards=touched(ids, shards)[0],
               ids=ids.tolist())  # fmt: skip
    if counting is not None:
        read = np.flatnonzero(counting.read)
        out["index_rows_read"] = len(read)
        out["index_rows_in_stream"] = int(np.isin(read, stream_ids(layout, stream)).sum())
    return out


def stream_ids(layout: Any, stream: int) -> np.ndarray:
    """Every sample id of one stream."""
    return np.concatenate([layout.block_ids(stream, b)[0] for b in range(layout.blocks[stream])])


def run_measure(args: argparse.Namespace, index: str, record: str, memory: bool) -> dict[str, Any]:
    """One ``measure`` in a fresh interpreter."""
    argv = [sys.executable, os.path.abspath(__file__), "measure", "--index", index, "--record",
            record, "--step", str(args.step), "--rank", str(args.rank), "--micro",
            str(args.micro), "--world", str(args.world), "--block", str(args.block), "--mode",
            args.mode, "--max-tokens", str(args.max_tokens), "--seq-len", str(args.seq_len),
            "--packing", args.packing, "--grad-accum", str(args.grad_accum)]  # fmt: skip
    if memory:
        argv.append("--memory")
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def check(folder: str, args: argparse.Namespace, got: dict[str, Any]) -> bool:
    """The seek's batch equals the whole ``StreamPlan``'s batch of that global index."""
    from shardcache.read.plan.streams import StreamPlan, count_batches

    layout = layout_of(folder, args, got["epoch"])
    plan = StreamPlan(layout, options(args), count_batches(layout, options(args)))
    return np.asarray(plan.batch(got["global_batch"])).tolist() == got["ids"]


def simulate(args: argparse.Namespace) -> dict[str, Any]:
    """Part 1 (see the module docstring)."""
    figures: dict[str, Any] = {}
    for n in counts(args.sequences):
        folder = make_index(args.work, n, args.rows_per_shard)
        start = time.perf_counter()
        record, setup = write_record(folder, args, args.work)
        print(f"{human(n)}: record at step {args.step} (epoch {setup['epoch']}), setup "
              f"{time.perf_counter() - start:.1f} s", flush=True)  # fmt: skip
        traced = run_measure(args, folder, record, memory=True)
        timed = [run_measure(args, folder, record, memory=False) for _ in range(args.repeats)]
        best = min(timed, key=lambda r: r["seek_s"])
        row = {**setup, "seek_s": best["seek_s"], "seek_s_all": [r["seek_s"] for r in timed],
               "warmup_s": best["warmup_s"], "traced_peak_mib": traced["traced_peak_mib"],
               "index_rows_read": traced["index_rows_read"],
               "index_rows_in_stream": traced["index_rows_in_stream"]}  # fmt: skip
        for key in ("global_batch", "stream", "stream_batch", "batch_sequences", "batch_shards"):
            row[key] = best[key]
        row["same_ids_every_process"] = all(r["ids"] == best["ids"] for r in [traced, *timed])
        row["check"] = check(folder, args, best) if n <= count(args.check_max) else None
        figures[human(n)] = row
        print(f"  seek {row['seek_s']:.3f} s (best of {args.repeats}), traced "
              f"{row['traced_peak_mib']:.1f} MiB, batch: {row['batch_sequences']} sequences in "
              f"{row['batch_shards']} shards, length rows read {row['index_rows_read']} "
              f"({row['index_rows_in_stream']} in the batch's stream), check "
              f"{row['check']}", flush=True)  # fmt: skip
    print(f"\nsim: step {args.step} rank {args.rank} micro {args.micro}, W = C = {args.world}, "
          f"grad_accum {args.grad_accum}, {args.mode}, max_tokens {args.max_tokens}, "
          f"shuffle_block {args.block}")  # fmt: skip
    print("\n| N | epoch | global batch | seek s (best of "
          f"{args.repeats}) | traced MiB | batch shards | shards read besides | equal to the "
          "full plan |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for name, row in figures.items():
        print(f"| {name} | {row['epoch']} | {row['global_batch']} | {row['seek_s']:.3f} | "
              f"{row['traced_peak_mib']:.1f} | {row['batch_shards']} | 0 | "
              f"{row['check'] if row['check'] is not None else '-'} |")  # fmt: skip
    return {"sim": figures}


def real(args: argparse.Namespace) -> dict[str, Any]:
    """Part 2 (see the module docstring)."""
    from shardcache import ShardDataset
    from shardcache.read.rewind import Rewinder
    from shardcache.store.cache import ShardCache

    source = os.path.join(HERE, "..", "tests", "read", "data", "matrix", "text_a")
    work = tempfile.mkdtemp(prefix="rewind-real-")
    try:
        cache = os.path.join(work, "text_a")
        shutil.copytree(source, cache)
        world = args.real_world
        with ShardDataset(cache, max_tokens=256, rank=0, world_size=world) as ds:
            for epoch in range(args.real_epochs):
                ds.split(epoch)  # (the reader notes each epoch's counts and stream length)
            record = ds.run_record()
        opened: list[int] = []
        original = ShardCache.get

        def get(self: ShardCache, index: int) -> Any:
            opened.append(index)
            return original(self, index)

        ShardCache.get = get  # type: ignore[method-assign]
        read = used = batches = 0
        try:
            with Rewinder(record) as rewinder:
                starts = rewinder.cache(0).shard_starts
                last = sum(record.epoch_batches.values()) // world - 1
                for step in np.linspace(0, last, args.real_steps).astype(int).tolist():
                    for rank in range(world):
                        opened.clear()
                        (got,) = rewinder.step(step, rank, 0)
                        ids = np.asarray(got.batch["meta"]["sample_ids"])
                        mine = set((np.searchsorted(starts, ids, side="right") - 1).tolist())
                        read += len(set(opened) - mine)
                        used += len(mine)
                        batches += 1
        finally:
            ShardCache.get = original  # type: ignore[method-assign]
        figures = {"batches": batches, "batch_shards": used, "shards_read_besides": read,
                   "epochs": args.real_epochs, "world": world,
                   "epoch_rounds": len(record.epoch_rounds)}  # fmt: skip
        print(
            f"\nreal: {batches} batches of {args.real_steps} steps over {args.real_epochs} "
            f"epochs (W = C = {world}): {used} batch shards, {read} other shards read"
        )
        return {"real": figures}
    finally:
        shutil.rmtree(work, ignore_errors=True)


def parser() -> argparse.ArgumentParser:
    """The options (a few for the ``measure`` subprocess only)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("command", nargs="?", default="run", choices=("run", "measure"),
                   help=argparse.SUPPRESS)  # fmt: skip
    p.add_argument("--part", default="all", choices=("all", "sim", "real"))
    p.add_argument(
        "--work",
        default=os.path.join(tempfile.gettempdir(), "shardcache-bench-scale"),
        help="where the synthetic indexes and counts are kept between runs",
    )
    p.add_argument("--sequences", default="20M,60M,200M")
    p.add_argument("--step", type=int, default=10**6)
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--micro", type=int, default=0)
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--world", type=int, default=1024, help="W, and the streams C")
    p.add_argument("--rows-per-shard", type=int, default=1000)
    p.add_argument("--repeats", type=int, default=3, help="best of, one process each")
    p.add_argument("--mode", default="pad", choices=("pad", "pack"))
    p.add_argument("--packing", default="best_fit", choices=("best_fit", "concat"))
    p.add_argument("--max-tokens", type=int, default=16 * 4096)
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--block", type=int, default=1 << 18, help="shuffle_block")
    p.add_argument("--check-max", default="200M", help="sim: compare with the whole plan up to")
    p.add_argument("--real-world", type=int, default=2)
    p.add_argument("--real-epochs", type=int, default=3)
    p.add_argument("--real-steps", type=int, default=12)
    p.add_argument("--index", help=argparse.SUPPRESS)
    p.add_argument("--record", help=argparse.SUPPRESS)
    p.add_argument("--memory", action="store_true", help=argparse.SUPPRESS)
    return p


def main() -> None:
    """Run the parts, print their tables, record one result line."""
    args = parser().parse_args()
    if args.command == "measure":
        print(json.dumps(measure(args)))
        return
    os.makedirs(args.work, exist_ok=True)
    figures: dict[str, Any] = {}
    if args.part in ("all", "sim"):
        figures.update(simulate(args))
    if args.part in ("all", "real"):
        figures.update(real(args))
    record_result("bench_rewind", figures, {k: v for k, v in vars(args).items()
                                            if k not in ("command", "index", "record",
                                                         "memory")})  # fmt: skip


if __name__ == "__main__":
    main()
