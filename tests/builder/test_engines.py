"""Job arrays (``--partition i/N`` + ``shardcache commit``) and engine selection."""

from __future__ import annotations

import dataclasses
import os

import pytest
from click.testing import CliRunner

from conftest import folder_files as tree
from conftest import kill_env
from shardcache import build_cache
from shardcache.builder.commit import commit_output
from shardcache.builder.engines import EngineOptions, Share
from shardcache.builder.run import build
from shardcache.cli import main
from shardcache.config import build_options_from_mapping
from shardcache.errors import CacheError, ConfigError, IncompleteBuildError

OPTIONS = {"partition_size": "2KiB", "shard_size": 4096, "buckets": "16,64", "batch_docs": 16}


def _options(folder: str, tokenizer: str, out: str, **extra):
    values = {"input": folder, "tokenizer": tokenizer, "output": out, "workers": 1}
    return build_options_from_mapping({**values, **OPTIONS, **extra})


@pytest.fixture()
def local_reference(corpus, tokenizer_dir, tmp_path):
    folder, _ = corpus("jsonl", n_files=3, docs=60)
    out = str(tmp_path / "reference")
    build_cache(_options(folder, tokenizer_dir, out))
    return folder, out


def test_share_parse_and_selection():
    share = Share.parse("1/3")
    assert (share.index, share.count) == (1, 3)
    assert [k for k in range(8) if share.owns(k)] == [1, 4, 7]
    for bad in ("3/3", "x", "1/0", "-1/2"):
        with pytest.raises(ConfigError, match="partition"):
            Share.parse(bad)
    with pytest.raises(ConfigError, match="engine"):
        EngineOptions(engine="spark")


def test_two_shares_then_commit_equal_the_local_build(local_reference, tokenizer_dir, tmp_path):
    folder, reference = local_reference
    out = str(tmp_path / "array")
    for i in (1, 0):  # any order
        build(_options(folder, tokenizer_dir, out), EngineOptions(share=Share(i, 2)))
        assert not os.path.exists(os.path.join(out, "manifest.json"))
    report = commit_output(out)
    assert report.partitions > 4
    assert tree(out) == tree(reference)
    assert commit_output(out).documents == report.documents  # idempotent


def test_commit_with_a_missing_share_names_partitions_and_share(
    local_reference, tokenizer_dir, tmp_path
):
    folder, _ = local_reference
    out = str(tmp_path / "array")
    build(_options(folder, tokenizer_dir, out), EngineOptions(share=Share(0, 2)))
    with pytest.raises(IncompleteBuildError, match=r"p00001, p00003.*share\(s\) 1/2") as err:
        commit_output(out)
    assert err.value.missing[0] == "p00001"
    assert not os.path.exists(os.path.join(out, "manifest.json"))
    result = CliRunner().invoke(main, ["commit", out])
    assert result.exit_code == 1
    assert "not built: p00001" in result.output and "1/2" in result.output


def test_cli_partition_and_commit(local_reference, tokenizer_dir, tmp_path):
    folder, reference = local_reference
    out = str(tmp_path / "cli")
    args = ["build", "-i", folder, "-t", tokenizer_dir, "-o", out, "-w", "1", "-q",
            "--partition-size", "2KiB", "--shard-size", "4096", "--buckets", "16,64",
            "--batch-docs", "16"]  # fmt: skip
    runner = CliRunner()
    for i in range(3):
        result = runner.invoke(main, [*args, "--partition", f"{i}/3"])
        assert result.exit_code == 0, result.output
    assert runner.invoke(main, ["commit", out]).exit_code == 0
    assert tree(out) == tree(reference)
    bad = runner.invoke(main, [*args, "--partition", "5/3"])
    assert bad.exit_code == 2 and "0 <= i < N" in bad.output


def test_share_refuses_other_options_and_force(local_reference, tokenizer_dir, tmp_path):
    folder, _ = local_reference
    out = str(tmp_path / "array")
    build(_options(folder, tokenizer_dir, out), EngineOptions(share=Share(0, 2)))
    with pytest.raises(CacheError, match="same options and inputs"):
        build(_options(folder, tokenizer_dir, out, max_length=8), EngineOptions(share=Share(1, 2)))
    forced = dataclasses.replace(_options(folder, tokenizer_dir, out), force=True)
    with pytest.raises(ConfigError, match="--force cannot be combined"):
        build(forced, EngineOptions(share=Share(1, 2)))


def test_a_share_restarting_while_another_runs_leaves_its_files_alone(
    corpus, tokenizer_dir, tmp_path, monkeypatch
):
    """Two shares of a 13-partition build at once: share 1 is killed mid-run, then restarted
    while share 0 is in the middle of a partition (its quarantine file, and shards, are in
    flight). The restart must not delete share 0's files; both finish, and the commit
    equals a local build byte for byte."""
    import subprocess
    import sys

    from shardcache.builder import fault_points

    folder, _ = corpus("jsonl", n_files=3, docs=100)
    extra = {"partition_size": "3KiB"}
    reference = str(tmp_path / "reference")
    build_cache(_options(folder, tokenizer_dir, reference, **extra))
    out = str(tmp_path / "array")
    args = [sys.executable, "-m", "shardcache.cli", "build", "-i", folder, "-t", tokenizer_dir,
            "-o", out, "-w", "1", "-q", "--partition-size", "3KiB", "--shard-size", "4096",
            "--buckets", "16,64", "--batch-docs", "16", "--partition", "1/2"]  # fmt: skip
    env = {**os.environ, **kill_env("batch:3")}
    killed = subprocess.run(args, env=env, capture_output=True, timeout=300)
    assert killed.returncode == -9, killed.stderr.decode()[-2000:]  # share 1 died mid-run
    env.pop("SHARDCACHE_TEST_KILL")
    restarts = []

    def restart_share_1_mid_partition(event: str) -> None:
        in_flight = [n for sub in ("shards", "parts") for n in os.listdir(os.path.join(out, sub))
                     if n.endswith(".tmp") and int(n[1:6]) % 2 == 0]  # fmt: skip
        if event == "batch" and not restarts and in_flight:
            restarts.append(in_flight)
            done = subprocess.run(args, env=env, capture_output=True, timeout=300)
            assert done.returncode == 0, done.stderr.decode()[-2000:]

    monkeypatch.setattr(fault_points, "hook", restart_share_1_mid_partition)
    build(_options(folder, tokenizer_dir, out, **extra), EngineOptions(share=Share(0, 2)))
    assert restarts and any(".quarantine.jsonl" in n for n in restarts[0]), restarts
    report = commit_output(out)
    assert report.partitions == 13
    assert tree(out) == tree(reference)


# --- mutual exclusion: a full build, shares, shares of another N ---------------------------


def _hold(path, pid: int) -> None:
    """Write a build lock at ``path`` (a ``.lock`` file) held by the live process ``pid``."""
    import json
    import socket
    import time

    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump({"pid": pid, "host": socket.gethostname(), "started": time.time()}, f)


@pytest.fixture()
def live_pid():
    import subprocess
    import sys

    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    yield holder.pid
    holder.kill()
    holder.wait()


@pytest.mark.parametrize(
    "running, mine, named",
    [
        (".lock", Share(0, 2), "a full build"),  # a share beside a full build
        (".shares/share-1-of-2/.lock", None, "share 1/2"),  # a full build beside a share
        (".shares/share-0-of-2/.lock", Share(1, 3), "share 0/2"),  # shares of another N
    ],
)
def test_a_build_beside_a_running_one_it_would_collide_with_is_refused(
    corpus, tokenizer_dir, tmp_path, live_pid, running, mine, named
):
    from shardcache.errors import BuildLockedError

    folder, _ = corpus("jsonl", n_files=3, docs=60)
    out = tmp_path / "out"
    _hold(str(out / running), live_pid)
    with pytest.raises(BuildLockedError, match=rf"{named}.*pid {live_pid}"):
        build(_options(folder, tokenizer_dir, str(out)), EngineOptions(share=mine))
    assert not (out / "parts").exists() or not os.listdir(out / "parts")  # nothing written


def test_shares_of_one_count_run_side_by_side(local_reference, tokenizer_dir, tmp_path, live_pid):
    folder, reference = local_reference
    out = tmp_path / "array"
    _hold(str(out / ".shares/share-1-of-2/.lock"), live_pid)  # share 1/2 is running
    build(_options(folder, tokenizer_dir, str(out)), EngineOptions(share=Share(0, 2)))
    os.remove(out / ".shares/share-1-of-2/.lock")
    build(_options(folder, tokenizer_dir, str(out)), EngineOptions(share=Share(1, 2)))
    commit_output(str(out))
    assert tree(str(out)) == tree(reference)


def test_one_process_runs_text_partitions_two_at_a_time(corpus, tokenizer_dir, tmp_path,
                                                        monkeypatch):  # fmt: skip
    """A one-worker build overlaps two text partitions in threads (each with its own encoder
    copy); the cache is byte-identical to one built a partition at a time, and the partitions'
    process CPU adds up to the run's."""
    import threading
    import time

    from shardcache.builder import pool

    folder, _ = corpus("jsonl", n_files=3, docs=60)
    real, running, most = pool.build_partition, [0], [0]
    encoders: set[int] = set()
    lock = threading.Lock()

    def counting(plan, partition, encoder, progress):
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
            encoders.add(id(encoder))
        time.sleep(0.05)  # the next partition starts meanwhile
        try:
            return real(plan, partition, encoder, progress)
        finally:
            with lock:
                running[0] -= 1

    monkeypatch.setattr(pool, "build_partition", counting)
    overlapped = str(tmp_path / "overlapped")
    report = build_cache(_options(folder, tokenizer_dir, overlapped))
    assert most[0] == pool.IN_FLIGHT and len(encoders) == report.partitions > 4
    assert report.stages["process"] > 0
    monkeypatch.setattr(pool, "IN_FLIGHT", 1)
    one_at_a_time = str(tmp_path / "sequential")
    build_cache(_options(folder, tokenizer_dir, one_at_a_time))
    assert tree(overlapped) == tree(one_at_a_time)


def test_apportion_process_cpu_splits_the_run_by_encode_time():
    from shardcache.builder.build_plan import PartitionResult
    from shardcache.builder.pool import apportion_process_cpu
    from shardcache.builder.tokenize import TruncationStats

    results = [PartitionResult(f"p{i}", "a.jsonl", "", [], TruncationStats(), {}) for i in range(2)]
    results[0].timings = {"read": 0.5, "parse": 0.5, "encode_busy": 3.0, "tokenizer": 9.0}
    results[1].timings = {"bucket": 0.25, "encode_busy": 1.0, "tokenizer": 9.0}
    apportion_process_cpu(results, 8.0)
    assert [r.timings["process"] for r in results] == [6.0, 2.0]
    assert [r.timings["tokenizer"] for r in results] == [5.0, 1.75]
