"""Ray engine and object storage, end to end: a local Ray cluster, and a real S3 API server
(moto's standalone server) on 127.0.0.1. Slow tier: run with ``-m slow`` (CI does)."""

from __future__ import annotations

import contextlib
import os
import warnings

import pytest

from conftest import folder_files as tree
from conftest import free_port, kill_env
from shardcache import ShardDataset, build_cache, open_cache, verify_cache
from shardcache.builder.commit import commit_output
from shardcache.builder.engines import EngineOptions, Share
from shardcache.builder.run import build
from shardcache.config import build_options_from_mapping
from shardcache.store.check import cache_key

pytestmark = [
    pytest.mark.slow,
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.filterwarnings("ignore::ResourceWarning"),
    pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning"),
]

OPTIONS = {"partition_size": "2KiB", "shard_size": 4096, "buckets": "16,64", "batch_docs": 16}


def _options(inputs, tokenizer: str, out: str, **extra):
    values = {"input": inputs, "tokenizer": tokenizer, "output": out, "workers": 2}
    return build_options_from_mapping({**values, **OPTIONS, **extra})


@pytest.fixture()
def reference(corpus, tokenizer_dir, tmp_path):
    folder, _ = corpus("jsonl", n_files=3, docs=60)
    out = str(tmp_path / "reference")
    build_cache(_options(folder, tokenizer_dir, out, workers=1))
    return folder, out


def test_ray_build_equals_local_build(reference, tokenizer_dir, tmp_path):
    ray = pytest.importorskip("ray")
    folder, ref = reference
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        out = str(tmp_path / "ray")
        report = build(_options(folder, tokenizer_dir, out), EngineOptions(engine="ray"))
        assert report.partitions > 4
        assert tree(out) == tree(ref)
        # a share run through Ray, the other locally, then commit: the same bytes again
        out2 = str(tmp_path / "ray-shares")
        build(_options(folder, tokenizer_dir, out2), EngineOptions("ray", share=Share(0, 2)))
        build(_options(folder, tokenizer_dir, out2), EngineOptions(share=Share(1, 2)))
        commit_output(out2)
        assert tree(out2) == tree(ref)
    finally:
        ray.shutdown()


def test_ray_retries_a_killed_task_without_partial_output(
    reference, tokenizer_dir, tmp_path, monkeypatch
):
    ray = pytest.importorskip("ray")
    folder, ref = reference
    marker = tmp_path / "killed-once"
    # the worker running the 2nd encode batch it sees SIGKILLs itself, once; Ray retries
    for name, value in kill_env("batch:2", once=str(marker)).items():
        monkeypatch.setenv(name, value)  # Ray's workers inherit them
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        out = str(tmp_path / "ray-retry")
        build(_options(folder, tokenizer_dir, out), EngineOptions(engine="ray"))
    finally:
        ray.shutdown()
    assert marker.exists(), "no task was killed: the test did not test a retry"
    assert tree(out) == tree(ref)  # the retried partition was rewritten whole


def _upload_folder(client, folder: str, prefix: str) -> None:
    for name in sorted(os.listdir(folder)):
        client.upload_file(os.path.join(folder, name), "corpus", f"{prefix}/{name}")


def test_s3_build_read_verify(s3, reference, tokenizer_dir, tmp_path):
    folder, ref = reference
    _upload_folder(s3, folder, "raw")
    url = "s3://corpus/caches/c1"
    build(_options("s3://corpus/raw", tokenizer_dir, url, workers=1))
    # the manifest is on the store; every object equals the local build's file
    local = tree(ref)
    listed = s3.list_objects_v2(Bucket="corpus", Prefix="caches/c1/")["Contents"]
    objects = {o["Key"][len("caches/c1/") :] for o in listed}
    assert objects == set(local)
    for rel in ("manifest.json", "index/lengths.npy", "quarantine.jsonl"):
        body = s3.get_object(Bucket="corpus", Key=f"caches/c1/{rel}")["Body"].read()
        if rel != "manifest.json":
            assert body == local[rel]
    manifest = open_cache(url).manifest
    reference_manifest = open_cache(ref).manifest
    assert manifest["shards"] == reference_manifest["shards"]
    assert [(i["relpath"], i["size"], i["sha256"]) for i in manifest["inputs"]] == [
        (i["relpath"], i["size"], i["sha256"]) for i in reference_manifest["inputs"]
    ]
    assert cache_key(url).digest == cache_key(ref).digest

    # read back: the same sequences, through the local shard cache
    remote, here = open_cache(url), open_cache(ref)
    assert [s.ids.tolist() for s in remote.iter_sequences()] == [
        s.ids.tolist() for s in here.iter_sequences()
    ]
    ds_remote = ShardDataset(url, max_tokens=256, seed=1)
    ds_local = ShardDataset(ref, max_tokens=256, seed=1)
    for a, b in zip(ds_remote, ds_local, strict=True):
        assert a["input_ids"].tolist() == b["input_ids"].tolist()
    report = verify_cache(url)
    assert report.ok, report.problems

    # a corrupted object: verify names it, the reader refuses it on download
    name = manifest["shards"][0]["name"]
    key = f"caches/c1/shards/{name}"
    data = bytearray(s3.get_object(Bucket="corpus", Key=key)["Body"].read())
    data[len(data) // 2] ^= 0xFF
    s3.put_object(Bucket="corpus", Key=key, Body=bytes(data))
    report = verify_cache(url)
    assert not report.ok and any(name in p.file for p in report.problems)
    import shutil

    from shardcache.errors import CorruptShardError

    shutil.rmtree(os.environ["SHARDCACHE_CACHE_DIR"])
    with pytest.raises(CorruptShardError, match="checksum mismatch on download"):
        open_cache(url).read(0)


def test_s3_job_array_and_bounded_local_cache(s3, reference, tokenizer_dir, monkeypatch):
    folder, ref = reference
    url = "s3://corpus/caches/array"
    for i in (0, 1):
        build(_options(folder, tokenizer_dir, url, workers=1), EngineOptions(share=Share(i, 2)))
    assert "Contents" not in s3.list_objects_v2(Bucket="corpus", Prefix="caches/array/manifest")
    commit_output(url)
    here = open_cache(ref)
    # a local shard cache smaller than the cache (each shard fits, not all): old shards are
    # evicted, reads stay right
    sizes = [int(s["bytes"]) for s in here.manifest["shards"]]
    assert len(sizes) >= 2
    monkeypatch.setenv("SHARDCACHE_CACHE_SIZE", str(max(max(sizes), sum(sizes) // 2)))
    remote = open_cache(url)
    assert remote.manifest["shards"] == here.manifest["shards"]
    assert [s.ids.tolist() for s in remote.iter_sequences()] == [
        s.ids.tolist() for s in here.iter_sequences()
    ]
    objects = os.path.join(os.environ["SHARDCACHE_CACHE_DIR"], "objects")
    kept = [n for n in os.listdir(objects) if n.endswith(".arrow")]
    assert 0 < len(kept) < len(here.manifest["shards"])


_RANK_READER = """
import json, sys
from torch.utils.data import DataLoader
from shardcache import ShardDataset

url, rank, world, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
ds = ShardDataset(url, max_tokens=256, seed=1, rank=rank, world_size=world)
batches = [b["input_ids"].tolist() for b in DataLoader(ds, batch_size=None, num_workers=2)]
with open(out, "w") as f:
    json.dump(batches, f)
"""


def test_s3_readers_sharing_a_tiny_local_cache_never_deadlock(
    s3, reference, tokenizer_dir, tmp_path, monkeypatch
):
    """Issue 12 item 4: 4 processes x 2 DataLoader workers, one SHARDCACHE_CACHE_DIR far
    smaller than the cache, cold then warm: all finish (hang guard) with the batches a local
    read gives."""
    import json
    import subprocess
    import sys

    folder, ref = reference
    url = "s3://corpus/caches/shared"
    build(_options(folder, tokenizer_dir, url, workers=1))
    monkeypatch.setenv("SHARDCACHE_CACHE_SIZE", "16KiB")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": root}
    world = 4
    expected = [
        [
            b["input_ids"].tolist()
            for b in ShardDataset(ref, max_tokens=256, seed=1, rank=r, world_size=world)
        ]
        for r in range(world)
    ]
    for run in ("cold", "warm"):
        outs = [str(tmp_path / f"{run}-{r}.json") for r in range(world)]
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", _RANK_READER, url, str(r), str(world), outs[r]],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                start_new_session=True,  # the hang guard kills the workers too
            )
            for r in range(world)
        ]
        try:
            logs = [p.communicate(timeout=300)[0] for p in procs]
        except subprocess.TimeoutExpired:
            import signal

            for p in procs:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.communicate()
            pytest.fail(f"{run} run: readers sharing one local shard cache hung")
        assert [p.returncode for p in procs] == [0] * world, logs
        for r in range(world):
            with open(outs[r]) as f:
                assert json.load(f) == expected[r], f"{run} run, rank {r}"


# ------------------------------------------- builds into object storage, no shared folder

_BUILDER = """
import json, sys
from shardcache.builder.commit import commit_output
from shardcache.builder.engines import EngineOptions, Share
from shardcache.builder.run import build
from shardcache.config import build_options_from_mapping

values, share = json.loads(sys.argv[1]), sys.argv[2]
if share == "commit":
    report = commit_output(values["output"])
else:
    engine = EngineOptions(share=Share.parse(share)) if share else EngineOptions()
    report = build(build_options_from_mapping(values), engine)
print("resumed", report.resumed_partitions)
"""


def _host(tmp_path, name: str) -> dict[str, str]:
    """The environment of a fresh machine: its own HOME and TMPDIR, and a local shard-cache
    folder that cannot be created (under a plain file), so any use of it fails."""
    home = tmp_path / "hosts" / name
    (home / "tmp").mkdir(parents=True)
    (home / "not-a-folder").write_text("")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return {**os.environ, "HOME": str(home), "TMPDIR": str(home / "tmp"), "PYTHONPATH": root,
            "SHARDCACHE_CACHE_DIR": str(home / "not-a-folder" / "cache")}  # fmt: skip


def _run_on(env: dict[str, str], values: dict, share: str = "", kill: str = "") -> tuple[int, str]:
    import json
    import subprocess
    import sys

    env = {**env, **kill_env(kill)} if kill else env
    proc = subprocess.run(
        [sys.executable, "-c", _BUILDER, json.dumps(values), share],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    return proc.returncode, proc.stdout + proc.stderr


def _resumed(log: str) -> int:
    """The partitions a build run by :func:`_run_on` resumed.

    A process runs two partitions at a time, each publishing its record right after its
    ``part`` fault point: a kill at ``part:3`` comes from a thread that already published its
    previous partition, so at least one was published, and the other may be mid-upload.
    """
    import re

    found = re.search(r"^resumed (\d+)$", log, flags=re.M)
    assert found, log
    return int(found.group(1))


def _store_tree(client, prefix: str, bucket: str = "corpus") -> dict[str, bytes]:
    listed = client.list_objects_v2(Bucket=bucket, Prefix=f"{prefix}/").get("Contents", [])
    return {
        o["Key"][len(prefix) + 1 :]: client.get_object(Bucket=bucket, Key=o["Key"])["Body"].read()
        for o in listed
    }


def _assert_same_cache(client, prefix: str, ref: str, bucket: str = "corpus") -> None:
    """Every object equals the local build's file; the manifests differ only where the
    inputs were named (URLs here, a folder there) and the plan files in their mtimes."""
    import json

    got, want = _store_tree(client, prefix, bucket), tree(ref)
    assert set(got) == set(want)
    for name in want:
        if name not in ("manifest.json", "parts/build.json"):
            assert got[name] == want[name], name
    a, b = json.loads(got["manifest.json"]), json.loads(want["manifest.json"])
    a["options"]["source"].pop("inputs")
    b["options"]["source"].pop("inputs")
    assert a == b


def test_s3_to_s3_build_uses_no_local_folder_and_resumes_on_another_machine(
    s3, reference, tokenizer_dir, tmp_path
):
    folder, ref = reference
    _upload_folder(s3, folder, "raw")
    values = {"input": ["s3://corpus/raw"], "tokenizer": tokenizer_dir, "workers": 2,
              "output": "s3://corpus/caches/moved", **OPTIONS}  # fmt: skip
    # machine A dies after its 3rd partition (workers=1: in the driver process itself)
    rc, log = _run_on(_host(tmp_path, "a"), {**values, "workers": 1}, kill="part:3")
    assert rc == -9, log
    assert "manifest.json" not in _store_tree(s3, "caches/moved")
    # machine B, fresh HOME / TMPDIR and no usable local cache folder, finishes the build
    rc, log = _run_on(_host(tmp_path, "b"), values)
    assert rc == 0, log
    assert _resumed(log) >= 1, log
    _assert_same_cache(s3, "caches/moved", ref)
    # inputs streamed (the local cache folder of each host is unusable); scratch folders of
    # partitions and commit are gone after a run that finished
    assert list((tmp_path / "hosts" / "b" / "tmp").iterdir()) == []


def test_s3_job_array_on_separate_hosts_with_a_restarted_share_and_commit(
    s3, reference, tokenizer_dir, tmp_path
):
    folder, ref = reference
    _upload_folder(s3, folder, "raw")
    values = {"input": ["s3://corpus/raw"], "tokenizer": tokenizer_dir, "workers": 1,
              "output": "s3://corpus/caches/array2", **OPTIONS}  # fmt: skip
    assert _run_on(_host(tmp_path, "share0"), values, "0/2")[0] == 0
    rc, log = _run_on(_host(tmp_path, "share1"), values, "1/2", kill="part:3")
    assert rc == -9, log
    rc, log = _run_on(_host(tmp_path, "share1-again"), values, "1/2")  # another host
    assert rc == 0 and _resumed(log) >= 1, log
    # a commit that dies before the manifest, then redone elsewhere
    rc, log = _run_on(_host(tmp_path, "commit"), values, "commit", kill="commit:3")
    assert rc == -9, log
    assert "manifest.json" not in _store_tree(s3, "caches/array2")
    rc, log = _run_on(_host(tmp_path, "commit-again"), values, "commit")
    assert rc == 0, log
    _assert_same_cache(s3, "caches/array2", ref)


# ------------------------------------------- the docs' cluster recipes, run as written


def _readme_cluster_blocks() -> list[list[str]]:
    """The commands of the bash blocks of the docs' "Running on a cluster" section
    (docs/guide/clusters.md; continuation lines joined, comments dropped)."""
    import re

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with open(os.path.join(root, "docs", "guide", "clusters.md"), encoding="utf-8") as f:
        section = f.read().split("## Running on a cluster", 1)[1].split("\n## ", 1)[0]
    blocks = []
    for block in re.findall(r"```bash\n(.*?)\n```", section, flags=re.S):
        text = block.replace("\\\n", " ")
        lines = [line.split("  #", 1)[0].strip() for line in text.splitlines()]
        blocks.append([" ".join(line.split()) for line in lines if line and line[0] != "#"])
    return blocks


def _wait_for_nodes(address: str, count: int, env: dict[str, str]) -> None:
    import subprocess
    import sys

    script = (
        "import ray, time, sys\n"
        f"ray.init(address={address!r}, logging_level='error')\n"
        "for _ in range(120):\n"
        f"    if len([n for n in ray.nodes() if n['Alive']]) >= {count}: sys.exit(0)\n"
        "    time.sleep(1)\n"
        "sys.exit(1)\n"
    )
    subprocess.run([sys.executable, "-c", script], env=env, check=True, timeout=180)


def test_readme_cluster_recipes_run_against_loopback_s3(
    s3, reference, tokenizer_dir, tmp_path, monkeypatch
):
    """The docs' Ray recipe (a head and a second node on this host, each with its own
    folders) and its SLURM job-array script (two shares on two "hosts", then commit), run
    from s3:// to s3://; the driver has no usable local cache folder; both caches equal a
    local build byte for byte."""
    import subprocess

    pytest.importorskip("ray")
    folder, _ = reference
    _upload_folder(s3, folder, "raw")
    s3.create_bucket(Bucket="caches")
    work = tmp_path / "work"
    (work / "recipes" / "quickstart").mkdir(parents=True)
    tokenizer = os.path.join("recipes", "quickstart", "tokenizer")  # (the docs' path)
    os.symlink(tokenizer_dir, work / tokenizer)
    monkeypatch.chdir(work)
    local = str(tmp_path / "local-ref")
    build_cache(build_options_from_mapping({"input": folder, "tokenizer": tokenizer,
                                            "output": local}))  # fmt: skip
    ray_block, sbatch_script, sbatch_submit = _readme_cluster_blocks()
    assert [c.split()[:2] for c in ray_block] == [["ray", "start"]] * 2 + [["shardcache", "build"]]

    import shutil
    import tempfile

    port = free_port()
    nodes = []
    ray_temp = tempfile.mkdtemp(prefix="sc-ray-", dir="/tmp")  # short: Unix socket paths
    ray_env = {"HEAD_IP": "127.0.0.1", "RAY_AUTH_MODE": "disabled"}  # loopback, no token files
    try:
        for k, command in enumerate(ray_block[:2]):
            env = {**_host(tmp_path, f"node{k}"), **ray_env}
            extra = " --block --num-cpus=1 --object-store-memory=80000000 --disable-usage-stats"
            extra += " --node-ip-address=127.0.0.1"
            if k == 0:
                extra += f" --include-dashboard=false --temp-dir={ray_temp}"
            else:  # a second node on this host: ports of its own
                extra += f" --dashboard-agent-listen-port={free_port()}"
                extra += f" --metrics-export-port={free_port()}"
                extra += f" --runtime-env-agent-port={free_port()}"
            line = command.replace("6379", str(port)) + extra
            nodes.append(
                subprocess.Popen(["bash", "-c", f"exec {line}"], env=env, cwd=work,
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                 start_new_session=True)
            )  # fmt: skip
            _wait_for_nodes(f"127.0.0.1:{port}", k + 1, env)
        driver = {**_host(tmp_path, "driver"), **ray_env}
        build_line = ray_block[2].replace("6379", str(port))
        proc = subprocess.run(["bash", "-c", build_line], env=driver, cwd=work,
                              capture_output=True, text=True, timeout=400)  # fmt: skip
        assert proc.returncode == 0, proc.stdout + proc.stderr
    finally:
        import signal

        for node in reversed(nodes):
            node.terminate()
        for node in reversed(nodes):
            with contextlib.suppress(subprocess.TimeoutExpired):
                node.wait(timeout=60)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(node.pid, signal.SIGKILL)  # what the node left (raylet, gcs)
        shutil.rmtree(ray_temp, ignore_errors=True)
    _assert_same_cache(s3, "v1", local, bucket="caches")

    # the job array: every share on its own "host", then the commit job
    for key in [o["Key"] for o in s3.list_objects_v2(Bucket="caches").get("Contents", [])]:
        s3.delete_object(Bucket="caches", Key=key)
    (share_line,) = sbatch_script
    for i in range(2):
        env = {**_host(tmp_path, f"array{i}"), "SLURM_ARRAY_TASK_ID": str(i),
               "SLURM_ARRAY_TASK_COUNT": "2"}  # fmt: skip
        proc = subprocess.run(["bash", "-c", share_line], env=env, cwd=work,
                              capture_output=True, text=True, timeout=300)  # fmt: skip
        assert proc.returncode == 0, proc.stdout + proc.stderr
    (commit_line,) = [c.split("--wrap '", 1)[1].rstrip("'") for c in sbatch_submit if "--wrap" in c]
    proc = subprocess.run(["bash", "-c", commit_line], env=_host(tmp_path, "commit-job"),
                          cwd=work, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    _assert_same_cache(s3, "v1", local, bucket="caches")


_RSS_BUILDER = """
import json, sys
import fsspec, s3fs, transformers, tokenizers, pyarrow.parquet
from shardcache.builder.run import build
from shardcache.config import build_options_from_mapping

# imports and the S3 client (botocore's service model: ~25 MB once) come first: not the build
fsspec.filesystem("s3").ls("corpus")
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # resets the peak RSS (VmHWM) of this process
build(build_options_from_mapping(json.loads(sys.argv[1])))
with open("/proc/self/status") as f:
    print("peak_kib", next(l.split()[1] for l in f if l.startswith("VmHWM")))
"""


def test_s3_inputs_are_streamed_in_the_memory_of_a_local_build(s3, corpus, tokenizer_dir, tmp_path):
    """Peak RSS of a build from s3:// equals that of the same build from local files within
    10% (inputs of 3 x ~6 MB, read in byte ranges: nothing is held or staged whole). The peak
    is measured from after the imports (Linux: ``/proc/self/clear_refs``), so it is the
    build's own memory, of which one input held whole would be a large part."""
    import json
    import subprocess
    import sys

    folder, _ = corpus("jsonl", n_files=3, docs=40)
    for name in os.listdir(folder):  # ~6 MB each: the same lines many times
        path = os.path.join(folder, name)
        with open(path, "rb") as f:
            data = f.read()
        with open(path, "wb") as f:
            f.write(data * (6_000_000 // len(data) + 1))
    _upload_folder(s3, folder, "big")
    peaks = {}
    for name, inputs, out in (("local", folder, str(tmp_path / "local-big")),
                              ("s3", "s3://corpus/big", "s3://corpus/caches/big")):  # fmt: skip
        values = {"input": inputs, "tokenizer": tokenizer_dir, "output": out, "workers": 1,
                  "partition_size": "2MiB", "shard_size": "1MiB"}  # fmt: skip
        proc = subprocess.run(
            [sys.executable, "-c", _RSS_BUILDER, json.dumps(values)],
            env=_host(tmp_path, f"rss-{name}"),
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr
        peaks[name] = int(proc.stdout.split("peak_kib", 1)[1])
    assert abs(peaks["s3"] - peaks["local"]) <= 0.1 * peaks["local"], peaks


def test_a_mixture_of_s3_sources_reads_as_the_local_one(s3, reference, corpus, tokenizer_dir):
    """Remote sources work in a mixture as single remote caches do: the same batches as the
    mixture of the same caches on local disk, and through DataLoader workers."""
    from torch.utils.data import DataLoader

    from shardcache.read.selection.mixture import Source

    _, web = reference
    other, _ = corpus("jsonl", n_files=1, docs=30, seed=7)
    code = os.path.join(os.path.dirname(web), "code")
    build_cache(_options(other, tokenizer_dir, code, workers=1))
    for name, path in (("web", web), ("code", code)):
        for root, _, files in os.walk(path):
            for file in files:
                rel = os.path.relpath(os.path.join(root, file), path)
                s3.upload_file(os.path.join(root, file), "corpus", f"mix/{name}/{rel}")

    def sources(web_path: str, code_path: str) -> list[Source]:
        return [Source(web_path, weight=0.6, name="web"),
                Source(code_path, weight=0.4, max_repetitions=2, name="code")]  # fmt: skip

    local = ShardDataset(sources(web, code), max_tokens=256, seed=2)
    remote = ShardDataset(sources("s3://corpus/mix/web", "s3://corpus/mix/code"), 256, seed=2)
    assert remote.mixture.to_json()["sources"][0]["tokens"] == local.mixture.sources[0].tokens
    want = [(b["input_ids"].tolist(), b["meta"]["source_ids"].tolist()) for b in local]
    got = [(b["input_ids"].tolist(), b["meta"]["source_ids"].tolist()) for b in remote]
    assert got == want and {s for _, ids in want for s in ids} == {0, 1}
    loader = DataLoader(remote, batch_size=None, num_workers=2)
    assert [(b["input_ids"].tolist(), b["meta"]["source_ids"].tolist()) for b in loader] == want
