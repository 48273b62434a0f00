"""Per-stage CPU times: always in the build report and its JSON, never in the cache."""

from __future__ import annotations

import json
import os

from shardcache.builder.report import format_report, report_json
from shardcache.builder.run import build_cache
from shardcache.builder.stage_times import StageTimes, format_stages
from shardcache.config import build_options_from_mapping


def _build(folder: str, tokenizer_dir: str, output: str, workers: int):
    values = {"input": folder, "tokenizer": tokenizer_dir, "output": output}
    values |= {"workers": workers, "batch_docs": 8, "partition_size": "2KiB"}
    return build_cache(build_options_from_mapping(values))


def test_a_build_reports_cpu_seconds_per_stage(corpus, tokenizer_dir, tmp_path):
    folder, _ = corpus("jsonl.zst", n_files=2, docs=40)
    report = _build(folder, tokenizer_dir, str(tmp_path / "out"), workers=1)
    stages = report.stages
    stages_listed = ("startup", "read", "parse", "tokenizer", "bucket", "write", "commit")
    for stage in (*stages_listed, "process"):
        assert stages[stage] >= 0.0, stage
    assert stages["encode_busy"] > 0.0
    # the stages measured in Python threads are parts of the partitions' process CPU
    python_side = stages["read"] + stages["parse"] + stages["bucket"] + stages["write"]
    assert python_side <= stages["process"] + 1e-3
    assert report_json(report)["stages"] == stages
    assert stages["startup"] > 0.0  # the tokenizer was loaded
    assert "cpu          startup " in format_report(report)


def test_timings_travel_from_workers_but_stay_out_of_the_cache(corpus, tokenizer_dir, tmp_path):
    folder, _ = corpus("jsonl", n_files=2, docs=40)
    out = str(tmp_path / "out")
    report = _build(folder, tokenizer_dir, out, workers=2)
    assert report.stages["encode_busy"] > 0.0  # sent back by the worker processes
    for root, _, files in os.walk(out):
        for name in files:
            if name.endswith(".json"):
                with open(os.path.join(root, name), encoding="utf-8") as f:
                    assert "timings" not in json.load(f), name
                    f.seek(0)
                    assert "encode_busy" not in f.read(), name


def test_stage_times_sum_across_threads_and_partitions():
    times = StageTimes()
    times.add("read", 1.0)
    times.merge({"read": 0.5, "write": 2.0, "custom": 1.0})
    with times.cpu("bucket"):
        sum(range(1000))
    assert times.to_json()["read"] == 1.5
    assert list(times.to_json()) == ["read", "bucket", "write", "custom"]  # pipeline order
    assert format_stages({}) == []
    (line,) = format_stages({"read": 1.0, "tokenizer": 3.0, "encode_busy": 2.5})
    assert "read 1.00s (25%)" in line and "tokenizer 3.00s (75%)" in line
    assert "encode 2.50s busy" in line
