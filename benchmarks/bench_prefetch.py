"""Benchmark: DevicePrefetcher vs the usual ways of feeding a GPU, on one CUDA device.

Run:  python benchmarks/bench_prefetch.py [--out DIR] [--quick]
      python benchmarks/bench_prefetch.py --cpu      # dry run on the CPU pass-through

Phases (about 1.5-2.5 minutes on one GPU):

0. Setup: versions and device properties; host-to-device peaks with a pinned source (P1) and a
   pageable source (P2), 1-256 MiB, timed with CUDA events; `torch.cuda._sleep` calibrated to ms.
1. Variants over two profiles, fed by one DataLoader (4 workers, batch_size=None) per pinning
   mode:
   (a) DataLoader(pin_memory=True) + batch.to(device, non_blocking=True) on the compute stream,
   (b) DataLoader(pin_memory=False) + batch.to(device) (pageable, synchronous),
   (c) DevicePrefetcher(DataLoader(pin_memory=False), depth=2 and 4).
   Profiles: "tokens" (input_ids/labels int64 [16, L], position_ids int32 [16, L], cu_seqlens,
   L in {2048, 4096, 8192}, 0.6-2.5 MiB) with a 2 ms compute step; "large" (one int64 tensor of
   16-64 MiB) with compute = 0.5x, 1.5x and 3x the P1 copy time of the mean batch.
   Each step first checksums the batch on the device (position-weighted int64 sum compared with
   the checksum computed on the CPU when the batch was made; the mismatch counter and the
   delivered sequence numbers stay on the device until the end), then runs the compute block.
   Every `--sync-every` steps the host waits for the device, as a training loop logging its loss.
2. Correctness: 20 steps of (c) under torch.cuda.set_sync_debug_mode("warn"); warnings counted.

Metrics (device events; one reference event first on the compute stream):
  stall %   = sum[(r_k - s_k) + max(0, s_k - e_{k-1})] / (e_last - s_first), where s_k is recorded
              before fetching batch k, r_k once it is usable on the compute stream, e_k after
              the compute block;
  overlap % = |union(copy) & union(compute)| / |union(copy)|, copies bracketed by events on the
              stream that runs them;
  copy GB/s = median over copies of bytes / copy time, and as % of P1 at the nearest size.
Targets: stall <= 2% when the producer keeps up; copy GB/s >= 80% of P1 for batches >= 16 MiB;
zero corrupted batches.

Without a CUDA device the script prints a message and exits with status 0, unless --cpu is given:
then it runs variant (b) and (c) on the CPU pass-through with tiny sizes (host timers instead of
events) to check that the code paths work; its figures mean nothing.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from results import record_result
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shardcache.read.device_prefetch import DevicePrefetcher, TorchDeviceBackend

MiB = 1 << 20
POOL = 6  # pre-generated batches per worker: generation costs nothing during the run
WEIGHT_MOD = 1021


# --------------------------------------------------------------------------------------------
# Workload
# --------------------------------------------------------------------------------------------


def checksum(t: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Position-weighted int64 sum: catches stale, mixed or shifted data, not only zeros."""
    flat = t.reshape(-1).to(torch.int64)
    return (flat * weights[: flat.numel()]).sum()


def make_weights(n: int, device: torch.device | str) -> torch.Tensor:
    return torch.arange(n, dtype=torch.int64, device=device) % WEIGHT_MOD + 1


def batch_checksum(batch: dict[str, torch.Tensor], weights: torch.Tensor) -> torch.Tensor:
    total = torch.zeros((), dtype=torch.int64, device=weights.device)
    for key, t in batch.items():
        if key not in ("seq", "checksum"):
            total = total + checksum(t, weights)
    return total


@dataclass(frozen=True)
class Profile:
    name: str
    scale: float  # 1.0 on GPU; tiny in --cpu mode

    def make(self, g: torch.Generator, i: int) -> dict[str, torch.Tensor]:
        if self.name == "tokens":
            seq_len = max(8, int([2048, 4096, 8192][i % 3] * self.scale))
            ids = torch.randint(0, 50_000, (16, seq_len), generator=g)
            n_docs = 1 + i % 7
            cu = torch.linspace(0, 16 * seq_len, n_docs + 1).to(torch.int32)
            return {
                "input_ids": ids,
                "labels": torch.roll(ids, -1, dims=1),
                "position_ids": torch.arange(seq_len, dtype=torch.int32).repeat(16, 1),
                "cu_seqlens": cu,
            }
        mib = [16, 32, 48, 64][i % 4] * self.scale
        n = max(64, int(mib * MiB) // 8)
        return {"data": torch.randint(0, 1 << 20, (n,), generator=g)}

    @property
    def max_numel(self) -> int:
        return int(max(16 * 8192 * self.scale, 64 * MiB * self.scale // 8)) + 64


class Batches(IterableDataset):
    """Yields already-collated batches; batch ``seq`` comes from worker ``seq % num_workers``, so
    a DataLoader (which reads its workers round robin) delivers ``seq`` 0, 1, 2, ... in order."""

    def __init__(self, profile: Profile, steps: int) -> None:
        self.profile = profile
        self.steps = steps

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        info = get_worker_info()
        wid, nw = (info.id, info.num_workers) if info is not None else (0, 1)
        g = torch.Generator().manual_seed(1234 + wid)
        weights = make_weights(self.profile.max_numel, "cpu")
        pool = []
        for i in range(POOL):
            b = self.profile.make(g, wid * POOL + i)
            b["checksum"] = batch_checksum(b, weights).reshape(1)
            pool.append(b)
        for seq in range(wid, self.steps, nw):
            b = dict(pool[(seq // nw) % POOL])
            b["seq"] = torch.tensor([seq], dtype=torch.int64)
            yield b


# --------------------------------------------------------------------------------------------
# Timing helpers: CUDA events on GPU, host clock on the CPU dry run
# --------------------------------------------------------------------------------------------


class Clock:
    """Timing marks on a stream; events of the same kind the prefetcher's backend uses
    (torch.Event or torch.cuda.Event), so elapsed times between them are valid."""

    def __init__(self, backend: TorchDeviceBackend | None) -> None:
        self.backend = backend

    def stream(self) -> Any:
        return self.backend.current_stream() if self.backend is not None else None

    def mark(self, stream: Any = None) -> Any:
        if self.backend is None:
            return time.perf_counter()
        ev = self.backend.new_event(True)
        self.backend.record(ev, stream if stream is not None else self.backend.current_stream())
        return ev

    def ms(self, ref: Any, mark: Any) -> float:
        if self.backend is None:
            return (mark - ref) * 1e3
        return self.backend.elapsed_ms(ref, mark)


class RecordingBackend(TorchDeviceBackend):
    """The real backend, plus timing events around every copy (for the overlap metric)."""

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        self.copies: list[tuple[Any, Any, int]] = []

    def copy_async(self, dst: torch.Tensor, src: torch.Tensor, stream: Any) -> None:
        c0, c1 = self.new_event(True), self.new_event(True)
        self.record(c0, stream)
        super().copy_async(dst, src, stream)
        self.record(c1, stream)
        self.copies.append((c0, c1, dst.numel()))


def union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def intersect_len(xs: list[tuple[float, float]], ys: list[tuple[float, float]]) -> float:
    total, i, j = 0.0, 0, 0
    while i < len(xs) and j < len(ys):
        lo, hi = max(xs[i][0], ys[j][0]), min(xs[i][1], ys[j][1])
        total += max(0.0, hi - lo)
        if xs[i][1] < ys[j][1]:
            i += 1
        else:
            j += 1
    return total


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(q * (len(s) - 1) + 0.5))]


# --------------------------------------------------------------------------------------------
# Phase 0: peaks and calibration
# --------------------------------------------------------------------------------------------


def h2d_peaks(device: torch.device, sizes_mib: list[int], reps: int) -> dict[str, dict[int, Any]]:
    stream = torch.cuda.Stream(device)
    pinned_gbps: dict[int, float] = {}
    pageable: dict[int, Any] = {}
    for mib in sizes_mib:
        n = mib * MiB
        dst = torch.empty(n, dtype=torch.uint8, device=device)
        src = torch.ones(n, dtype=torch.uint8).pin_memory()
        times = []
        with torch.cuda.stream(stream):
            for _ in range(reps):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                dst.copy_(src, non_blocking=True)
                b.record()
                b.synchronize()
                times.append(a.elapsed_time(b))
        pinned_gbps[mib] = n / (statistics.median(times) / 1e3) / 1e9
        del src
        page = torch.ones(n, dtype=torch.uint8)
        ev_t, wall_t = [], []
        for _ in range(max(3, reps // 4)):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0 = time.perf_counter()
            a.record()
            dst.copy_(page)
            b.record()
            wall_t.append(time.perf_counter() - t0)
            b.synchronize()
            ev_t.append(a.elapsed_time(b))
        pageable[mib] = {
            "event_gbps": n / (statistics.median(ev_t) / 1e3) / 1e9,
            "host_blocked_ms": 1e3 * statistics.median(wall_t),
        }
        del page, dst
    return {"pinned": pinned_gbps, "pageable": pageable}


def calibrate_sleep(device: torch.device) -> float:
    """Cycles of torch.cuda._sleep per millisecond (pure SM time, no memory traffic)."""
    cycles = 2_000_000
    torch.cuda._sleep(cycles)
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    torch.cuda._sleep(cycles)
    b.record()
    b.synchronize()
    return cycles / a.elapsed_time(b)


# --------------------------------------------------------------------------------------------
# Phase 1: one run of one variant
# --------------------------------------------------------------------------------------------


@dataclass
class RunSpec:
    variant: str  # "a_pinned_to", "b_pageable_to", "c_prefetch_d2", "c_prefetch_d4"
    profile: Profile
    compute_ms: float
    warmup: int
    steps: int


def run_variant(
    spec: RunSpec,
    loaders: dict[bool, DataLoader],
    device: torch.device,
    compute: Callable[[float], None],
    clock: Clock,
    sync_every: int,
    p1: dict[int, float],
) -> dict[str, Any]:
    cuda = device.type == "cuda"
    total = spec.warmup + spec.steps
    weights = make_weights(spec.profile.max_numel, device)
    mismatches = torch.zeros((), dtype=torch.int64, device=device)
    seqs = torch.full((total,), -1, dtype=torch.int64, device=device)
    prefetch_depth = {"c_prefetch_d2": 2, "c_prefetch_d4": 4}.get(spec.variant)
    pinned = spec.variant == "a_pinned_to"
    loader = loaders[pinned]
    backend = RecordingBackend(device) if (prefetch_depth and cuda) else None
    pf = None
    if prefetch_depth:
        # On the CPU dry run there is no backend: device="cpu" is the pass-through.
        dev_arg = None if backend is not None else device
        pf = DevicePrefetcher(loader, dev_arg, depth=prefetch_depth, backend=backend)
        source: Any = iter(pf)
    else:
        source = iter(loader)
    stream = clock.stream()
    marks: list[tuple[Any, Any, Any, Any, Any]] = []  # s, r, e, c0, c1 (copies of a/b)
    host_next: list[float] = []
    copy_bytes: list[int] = []
    ref = clock.mark(stream)
    mem_after_warmup = 0
    pinned_after_warmup = 0
    for k in range(total):
        if k == spec.warmup:
            if cuda:
                torch.cuda.synchronize(device)
                mem_after_warmup = torch.cuda.memory_reserved(device)
            pinned_after_warmup = pf.stats().pinned_bytes if pf is not None else 0
        s = clock.mark(stream)
        t0 = time.perf_counter()
        batch = next(source)
        c0 = c1 = None
        if pf is None:
            c0 = clock.mark(stream)
            batch = {key: v.to(device, non_blocking=pinned) for key, v in batch.items()}
            c1 = clock.mark(stream)
        host_next.append(time.perf_counter() - t0)
        r = clock.mark(stream)
        copy_bytes.append(sum(v.numel() * v.element_size() for v in batch.values()))
        mismatches += (batch_checksum(batch, weights) != batch["checksum"][0]).to(torch.int64)
        seqs[k : k + 1].copy_(batch["seq"])
        del batch  # the training step drops its batch; the allocator may reuse the block
        compute(spec.compute_ms)
        e = clock.mark(stream)
        marks.append((s, r, e, c0, c1))
        if sync_every and (k + 1) % sync_every == 0 and cuda:
            e.synchronize()
    if cuda:
        torch.cuda.synchronize(device)
    if pf is not None:
        source.close()  # stop the epoch (the DataLoader is reused by the next variant)
    stats = pf.stats() if pf is not None else None
    if pf is not None:
        pf.close()

    # derived metrics over the timed steps
    rows = [(clock.ms(ref, s), clock.ms(ref, r), clock.ms(ref, e)) for s, r, e, _, _ in marks]
    timed = rows[spec.warmup :]
    stall = sum(r - s for s, r, _ in timed)
    stall += sum(max(0.0, timed[i][0] - timed[i - 1][2]) for i in range(1, len(timed)))
    span = timed[-1][2] - timed[0][0]
    step_ms = [timed[i][2] - timed[i - 1][2] for i in range(1, len(timed))]
    compute_iv = union([(r, e) for _, r, e in timed])
    t_first = timed[0][0]
    copies: list[tuple[float, float, int]] = []
    if backend is not None:
        for c0, c1, nbytes in backend.copies:
            a, b = clock.ms(ref, c0), clock.ms(ref, c1)
            if a >= t_first:
                copies.append((a, b, nbytes))
    elif pf is None:
        for (_, _, _, c0, c1), nbytes in zip(
            marks[spec.warmup :], copy_bytes[spec.warmup :], strict=True
        ):
            copies.append((clock.ms(ref, c0), clock.ms(ref, c1), nbytes))
    copy_iv = union([(a, b) for a, b, _ in copies if b > a])
    copy_len = sum(b - a for a, b in copy_iv)
    overlap = intersect_len(copy_iv, compute_iv) / copy_len if copy_len > 0 else float("nan")
    gbps = [n / ((b - a) / 1e3) / 1e9 for a, b, n in copies if b > a]
    mean_mib = statistics.mean(copy_bytes) / MiB
    near = min(p1, key=lambda m: abs(math.log(m) - math.log(max(mean_mib, 1e-3)))) if p1 else None
    copy_gbps = statistics.median(gbps) if gbps else float("nan")
    got_seq = seqs.cpu().tolist()
    result = {
        "variant": spec.variant,
        "profile": spec.profile.name,
        "batch_mib": round(mean_mib, 2),
        "compute_ms": round(spec.compute_ms, 3),
        "step_ms_p50": pct(step_ms, 0.5),
        "stall_pct": 100 * stall / span if span > 0 else float("nan"),
        "overlap_pct": 100 * overlap,
        "copy_gbps": copy_gbps,
        "pct_of_p1": 100 * copy_gbps / p1[near] if near is not None else float("nan"),
        "host_next_ms_p50": 1e3 * pct(host_next[spec.warmup :], 0.5),
        "host_next_ms_p99": 1e3 * pct(host_next[spec.warmup :], 0.99),
        "mismatches": int(mismatches.item()),
        "out_of_order": sum(1 for i, s in enumerate(got_seq) if s != i),
        "reserved_growth_mib": (torch.cuda.memory_reserved(device) - mem_after_warmup) / MiB
        if cuda
        else 0.0,
        "pinned_growth_mib": ((stats.pinned_bytes if stats else 0) - pinned_after_warmup) / MiB,
    }
    if stats is not None:
        result.update(
            consumer_wait_s=stats.consumer_wait_s,
            source_wait_s=stats.source_wait_s,
            pack_s=stats.pack_s,
            slot_wait_s=stats.slot_wait_s,
            prefetch_copy_gbps=stats.copy_gbps,
            pinned_mib=stats.pinned_bytes / MiB,
        )
    return result


# --------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------

COLUMNS = [
    ("variant", "{}"),
    ("profile", "{}"),
    ("batch_mib", "{:.2f}"),
    ("compute_ms", "{:.2f}"),
    ("step_ms_p50", "{:.3f}"),
    ("stall_pct", "{:.2f}"),
    ("overlap_pct", "{:.1f}"),
    ("copy_gbps", "{:.1f}"),
    ("pct_of_p1", "{:.0f}"),
    ("host_next_ms_p99", "{:.3f}"),
    ("mismatches", "{}"),
    ("out_of_order", "{}"),
    ("reserved_growth_mib", "{:.0f}"),
    ("pinned_growth_mib", "{:.0f}"),
]


def table(results: list[dict[str, Any]]) -> str:
    head = "| " + " | ".join(c for c, _ in COLUMNS) + " |"
    sep = "|" + "|".join("---" for _ in COLUMNS) + "|"
    lines = [head, sep]
    for r in results:
        cells = []
        for c, fmt in COLUMNS:
            v = r.get(c, "")
            cells.append("n/a" if isinstance(v, float) and math.isnan(v) else fmt.format(v))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def clean(record: dict[str, Any]) -> dict[str, Any]:
    """NaN (a metric that does not apply) as null, so the JSON lines are standard JSON."""
    return {k: None if isinstance(v, float) and math.isnan(v) else v for k, v in record.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, help="folder for results.jsonl and table.md")
    ap.add_argument("--cpu", "--dry-run", action="store_true", help="CPU pass-through dry run")
    ap.add_argument("--quick", action="store_true", help="fewer steps (smoke test)")
    ap.add_argument("--num-workers", type=int, default=None)
    ap.add_argument("--sync-every", type=int, default=25)
    args = ap.parse_args(argv)

    cuda = torch.cuda.is_available() and not args.cpu
    if not cuda and not args.cpu:
        print(
            "bench_prefetch: no CUDA device is available (torch.cuda.is_available() is False); "
            "nothing was measured. Run on a GPU machine, or use --cpu for a dry run of the code "
            "paths on the CPU pass-through."
        )
        return 0
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    num_workers = args.num_workers if args.num_workers is not None else (4 if cuda else 2)
    clock = Clock(TorchDeviceBackend(device) if cuda else None)
    info: dict[str, Any] = {"torch": torch.__version__, "device": str(device)}
    p1: dict[int, float] = {}
    if cuda:
        props = torch.cuda.get_device_properties(device)
        info.update(
            cuda=torch.version.cuda,
            name=props.name,
            total_memory_gib=round(props.total_memory / 2**30, 1),
            sm_count=props.multi_processor_count,
            cpu_count=os.cpu_count(),
        )
        print(json.dumps(info))
        sizes = [1, 4, 16, 64] if args.quick else [1, 4, 16, 64, 256]
        peaks = h2d_peaks(device, sizes, reps=8 if args.quick else 20)
        p1 = peaks["pinned"]
        cycles_per_ms = calibrate_sleep(device)
        print("## Host-to-device peaks\n")
        print("| MiB | pinned GB/s (P1) | pageable GB/s (P2) | pageable host-blocked ms |")
        print("|---|---|---|---|")
        for mib in sizes:
            pg = peaks["pageable"][mib]
            print(
                f"| {mib} | {p1[mib]:.1f} | {pg['event_gbps']:.1f} | {pg['host_blocked_ms']:.2f} |"
            )
        print(f"\n_sleep calibration: {cycles_per_ms:.0f} cycles/ms\n")

        def compute(ms: float) -> None:
            torch.cuda._sleep(int(ms * cycles_per_ms))

    else:
        print(json.dumps(info))
        print("CPU dry run: pass-through only; the figures below mean nothing.\n")

        def compute(ms: float) -> None:
            end = time.perf_counter() + ms / 1e3
            while time.perf_counter() < end:
                pass

    scale = 1.0 if cuda else 1 / 256
    tokens, large = Profile("tokens", scale), Profile("large", scale)
    warm, steps_t, steps_l = (5, 30, 20) if args.quick else (20, 150, 100)
    if not cuda:
        warm, steps_t, steps_l = 3, 12, 8
    mean_large_mib = 40 * scale
    p1_large = p1.get(64, 1.0)
    copy_ms_large = mean_large_mib * MiB / (p1_large * 1e9) * 1e3 if cuda else 0.2
    plan: list[tuple[Profile, float, int]] = [(tokens, 2.0, steps_t)]
    plan += [(large, f * copy_ms_large, steps_l) for f in (0.5, 1.5, 3.0)]
    variants = ["a_pinned_to", "b_pageable_to", "c_prefetch_d2", "c_prefetch_d4"]
    if not cuda:
        variants = ["b_pageable_to", "c_prefetch_d2", "c_prefetch_d4"]  # no pinning on CPU

    results: list[dict[str, Any]] = []
    t_start = time.perf_counter()
    for profile in (tokens, large):
        runs = [(c, n) for p, c, n in plan if p is profile]
        n_max = max(n for _, n in runs) + warm
        ds = Batches(profile, n_max)
        # One loader per pinning mode, shared by the variants; iterator created (workers forked)
        # before any prefetcher thread starts.
        loaders = {
            pin: DataLoader(
                ds,
                batch_size=None,
                num_workers=num_workers,
                prefetch_factor=4 if num_workers else None,
                persistent_workers=num_workers > 0,
                pin_memory=pin,
            )
            for pin in ((False, True) if cuda else (False,))
        }
        for compute_ms, n in runs:
            for variant in variants:
                spec = RunSpec(variant, profile, compute_ms, warm, n)
                res = run_variant(spec, loaders, device, compute, clock, args.sync_every, p1)
                results.append(res)
                print(json.dumps(clean(res)), flush=True)
        del loaders

    if cuda:
        results.append(sync_debug_check(device, num_workers))
    elapsed = time.perf_counter() - t_start
    md = table(results)
    print("\n## Results\n")
    print(md)
    corrupted = sum(r.get("mismatches", 0) + r.get("out_of_order", 0) for r in results)
    print(f"\ncorrupted or out-of-order batches: {corrupted}; phase 1+2 took {elapsed:.0f} s")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        with open(args.out / "results.jsonl", "w") as f:
            f.write(json.dumps({"info": info, "p1_gbps": p1}) + "\n")
            for r in results:
                f.write(json.dumps(clean(r)) + "\n")
        (args.out / "table.md").write_text(md + "\n")
    if cuda:  # the CPU dry run's figures mean nothing
        figures = {"info": info, "p1_gbps": p1, "results": [clean(r) for r in results]}
        record_result("bench_prefetch", figures, args)
    return 1 if corrupted else 0


def sync_debug_check(device: torch.device, num_workers: int) -> dict[str, Any]:
    """20 steps of the prefetcher under sync-debug mode: any synchronising call warns."""
    ds = Batches(Profile("tokens", 1.0), 24)
    loader = DataLoader(ds, batch_size=None, num_workers=min(2, num_workers), pin_memory=False)
    weights = make_weights(16 * 8192 + 64, device)
    bad = torch.zeros((), dtype=torch.int64, device=device)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with DevicePrefetcher(loader, depth=2) as pf:
            torch.cuda.set_sync_debug_mode("warn")
            try:
                for batch in pf:
                    bad += (batch_checksum(batch, weights) != batch["checksum"][0]).to(torch.int64)
            finally:
                torch.cuda.set_sync_debug_mode("default")
    n_sync = sum(1 for w in caught if "synchroniz" in str(w.message).lower())
    res = {"variant": "sync_debug_c_d2", "profile": "tokens", "sync_warnings": n_sync}
    res["mismatches"] = int(bad.item())
    print(json.dumps(res))
    return res


if __name__ == "__main__":
    sys.exit(main())
