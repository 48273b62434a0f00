#!/usr/bin/env python3
"""What the stage timing and ``StallMonitor`` cost the reader: throughput with them on and off.

    python benchmarks/bench_monitor.py CACHE [--rounds 5] [--batches 200] [--mode pad]
                                             [--max-tokens 32768]

Reads ``--batches`` batches of ``ShardDataset`` (in-process, epoch after epoch;
``attention="none"`` for pack) with no training step, in alternating rounds: plain (no
timing), and through ``StallMonitor.wrap`` with ``step()`` after every batch (stage times in
``meta``, the figures computed, no writer). Prints the best batches/s of each and their ratio;
the rounds alternate so the machine's drift hits both. A small ``--max-tokens`` is the worst
case: the timing is a fixed cost a batch.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from results import record_result

from shardcache import ShardDataset, StallMonitor


def one_round(cache: str, batches: int, mode: str, max_tokens: int, monitored: bool) -> float:
    """Batches a second over one pass of ``batches`` batches."""
    options = {"mode": "pack", "seq_len": 2048, "attention": "none"} if mode == "concat" else {}
    if mode == "concat":
        options["packing"] = "concat"
    ds = ShardDataset(cache, max_tokens, seed=1, streams=0, **options)
    monitor = StallMonitor(ranks=False) if monitored else None
    began = time.perf_counter()
    n, epoch = 0, 0
    while n < batches:
        ds.set_epoch(epoch)
        epoch += 1
        for _ in monitor.wrap(ds) if monitor is not None else ds:
            if monitor is not None:
                monitor.step()
            n += 1
            if n == batches:
                break
    elapsed = time.perf_counter() - began
    ds.close()
    return n / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("cache")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batches", type=int, default=200)
    parser.add_argument("--mode", choices=["concat", "pad"], default="pad")
    parser.add_argument("--max-tokens", type=int, default=16 * 2048)
    args = parser.parse_args()
    one_round(args.cache, 5, args.mode, args.max_tokens, True)  # warm: page cache, numba
    rates: dict[str, list[float]] = {"off": [], "on": []}
    for _ in range(args.rounds):
        for name in ("off", "on"):
            rates[name].append(
                one_round(args.cache, args.batches, args.mode, args.max_tokens, name == "on")
            )
    figures = {
        "batches_per_s_off": round(max(rates["off"]), 1),
        "batches_per_s_on": round(max(rates["on"]), 1),
        "on_over_off": round(max(rates["on"]) / max(rates["off"]), 4),
        "rounds_off": [round(r, 1) for r in rates["off"]],
        "rounds_on": [round(r, 1) for r in rates["on"]],
    }
    print(json.dumps(figures))
    record_result("bench_monitor", figures, args)


if __name__ == "__main__":
    main()
