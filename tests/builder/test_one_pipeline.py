"""One pipeline, any output: a local build, a ``file://`` URL build and 3-way job-array builds
(into a folder and into a URL) of one corpus write the same files, byte for byte."""

from __future__ import annotations

from conftest import folder_files
from shardcache.builder.commit import commit_output
from shardcache.builder.engines import EngineOptions, Share
from shardcache.builder.run import build
from shardcache.config import build_options_from_mapping

OPTIONS = {"partition_size": "2KiB", "shard_size": 4096, "buckets": "16,64", "batch_docs": 16}


def test_local_url_and_share_builds_are_byte_identical(corpus, tokenizer_dir, tmp_path):
    folder, _ = corpus("jsonl", n_files=3, docs=60)

    def options(output: str):
        values = {"input": folder, "tokenizer": tokenizer_dir, "output": output, "workers": 1}
        return build_options_from_mapping({**values, **OPTIONS})

    local = str(tmp_path / "local")
    report = build(options(local))
    assert report.partitions >= 6  # split files: several partitions per share
    build(options(f"file://{tmp_path / 'url'}"))
    for where in (str(tmp_path / "shares"), f"file://{tmp_path / 'url-shares'}"):
        for i in (2, 0, 1):  # any order
            build(options(where), EngineOptions(share=Share(i, 3)))
        assert commit_output(where).partitions == report.partitions

    want = folder_files(local)
    assert "manifest.json" in want and any(n.startswith("shards") for n in want)
    for other in ("url", "shares", "url-shares"):
        got = folder_files(str(tmp_path / other))
        assert sorted(got) == sorted(want), other
        for name in want:  # every file, the manifest and the plan included
            assert got[name] == want[name], (other, name)
