"""Issue 13 items 13-14: ShardDataset arguments get clear answers (no raw tracebacks, no
silent wrong world size, no silently empty epoch)."""

from __future__ import annotations

import warnings

import pytest

from shardcache import ConfigError, ShardDataset, StateError
from shardcache.config import build_options_from_mapping


@pytest.fixture(scope="module")
def small_cache(tmp_path_factory, tokenizer_dir):
    from conftest import make_texts, write_records
    from shardcache.builder.run import build_cache

    folder = tmp_path_factory.mktemp("small")
    path = write_records(str(folder / "a.jsonl"), [{"text": t} for t in make_texts(30)], "jsonl")
    out = str(folder / "cache")
    values = {"input": path, "tokenizer": tokenizer_dir, "output": out, "workers": 1}
    build_cache(build_options_from_mapping(values))
    return out


def test_only_unknown_options_are_named_with_the_closest_valid_name(small_cache):
    with pytest.raises(ConfigError) as info:
        ShardDataset(small_cache, max_tokens=256, mode="pack", seq_len=64, atention="flash",
                     packin="concat")  # fmt: skip
    message = str(info.value)
    assert "'atention'" in message and "'packin'" in message
    assert "did you mean 'packing'" in message
    assert "'mode'" not in message.split(";")[0] and "'seq_len'" not in message.split(";")[0]


def test_unknown_recipe_keys_are_named_with_the_closest_valid_key():
    values = {"input": "x", "tokenizer": "t", "output": "o", "max_lenght": 8}
    with pytest.raises(ConfigError, match=r"'max_lenght'.*did you mean 'max_length'"):
        build_options_from_mapping(values)


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"rank": 1}, r"rank=1 without world_size"),
        ({"world_size": 4}, r"world_size=4 without rank"),
        ({"rank": "0", "world_size": 2}, r"rank: got '0'"),
        ({"seed": -1}, r"seed: got -1"),
        ({"seed": "1"}, r"seed: got '1'"),
    ],
)
def test_rank_world_size_and_seed_are_checked(small_cache, kwargs, pattern):
    with pytest.raises(ConfigError, match=pattern):
        ShardDataset(small_cache, max_tokens=256, **kwargs)


def test_a_non_integer_rank_variable_is_a_config_error(small_cache, monkeypatch):
    monkeypatch.setenv("RANK", "x")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match=r"RANK.*'x'"):
        ShardDataset(small_cache, max_tokens=256)


def test_a_state_past_the_end_of_its_epoch_is_refused(small_cache):
    ds = ShardDataset(small_cache, max_tokens=256)
    state = ds.state_dict()
    state["consumed"] = 10**12
    with pytest.raises(StateError, match=r"consumed=1000000000000.*batches"):
        ds.load_state_dict(state)
    state["consumed"] = len(ds.plan())  # the end of the epoch is a valid position
    ds.load_state_dict(state)


def test_an_epoch_past_int64_is_refused(small_cache):
    ds = ShardDataset(small_cache, max_tokens=256)
    state = ds.state_dict()
    state["epoch"] = 2**63
    with pytest.raises(StateError, match=r"epoch=9223372036854775808.*2\*\*63"):
        ds.load_state_dict(state)


def test_more_ranks_than_batches_warns(small_cache):
    ds = ShardDataset(small_cache, max_tokens=256, rank=0, world_size=64)
    with pytest.warns(UserWarning, match=r"world_size=64.*0 batches"):
        assert len(ds) == 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert len(ShardDataset(small_cache, max_tokens=256, rank=0, world_size=1)) > 0


# --- one view of a shard's tokens: a manifest cannot point the reader elsewhere ------------


def _file_tokens(cache: str) -> list[list[int]]:
    """Every stored sequence as the shard files' own Arrow metadata gives it (pyarrow: what
    ``verify --tokens`` reads), in manifest order."""
    import json
    import os

    import pyarrow as pa

    with open(os.path.join(cache, "manifest.json"), encoding="utf-8") as f:
        manifest = json.load(f)
    out = []
    for shard in manifest["shards"]:
        with pa.OSFile(os.path.join(cache, "shards", shard["name"])) as f:
            table = pa.ipc.open_file(f).read_all()
        out += table.column("tokens").to_pylist()
    return out


def _rewrite_manifest(cache: str, change) -> None:
    import json
    import os

    path = os.path.join(cache, "manifest.json")
    with open(path, encoding="utf-8") as f:
        manifest = json.load(f)
    change(manifest)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(manifest, f)


def _hide_payload(cache: str, manifest: dict) -> None:
    """Insert junk between each shard's last record batch and its Arrow footer (the file
    still reads the same through pyarrow), and record a layout pointing at the junk with the
    new sha256 and size, as whoever writes the manifest can."""
    import os

    from shardcache.store.files import sha256_file

    for shard in manifest["shards"]:
        path = os.path.join(cache, "shards", shard["name"])
        with open(path, "rb") as f:
            data = f.read()
        footer = len(data) - 10 - int.from_bytes(data[-10:-6], "little")
        payload = bytes(range(256)) * 64
        with open(path, "wb") as f:
            f.write(data[:footer] + payload + data[footer:])
        shard["sha256"], shard["bytes"] = sha256_file(path), os.path.getsize(path)
        shard["layout"] = {"tokens": {"offset": footer, "length": len(payload)},
                           "offsets": {"offset": footer + 8, "length": 64}}  # fmt: skip
    manifest["totals"]["shard_bytes"] = sum(s["bytes"] for s in manifest["shards"])


@pytest.mark.parametrize("kernels", [True, False], ids=["kernels", "numpy"])
def test_a_manifest_layout_lie_cannot_change_what_training_reads(tmp_path, small_cache, kernels):
    import shutil

    import numpy as np
    from click.testing import CliRunner

    from shardcache import open_cache
    from shardcache.cli import main

    cache = str(tmp_path / "cache")
    shutil.copytree(small_cache, cache)
    truth = _file_tokens(small_cache)
    _rewrite_manifest(cache, lambda m: _hide_payload(cache, m))
    assert _file_tokens(cache) == truth  # pyarrow's view is unchanged
    for args in (["verify", cache], ["verify", cache, "--tokens", "--fraction", "1"]):
        result = CliRunner().invoke(main, args)
        assert result.exit_code == 0, result.output
    with open_cache(cache) as opened:
        assert [opened.read(i).tolist() for i in range(opened.num_sequences)] == truth
    ds = ShardDataset(cache, max_tokens=4096, shuffle=False)
    ds.kernels = kernels
    read = []
    for batch in ds:
        ids, mask = batch["input_ids"].numpy(), batch["attention_mask"].numpy().astype(bool)
        read += [row[m].tolist() for row, m in zip(ids, mask)]
    assert sorted(read) == sorted(truth)
    assert np.isin(np.concatenate([np.asarray(t) for t in read]), np.arange(600)).all()


def test_a_manifest_dtype_lie_is_refused_not_read_as_junk(tmp_path, small_cache):
    import shutil

    from shardcache import CorruptShardError, open_cache

    cache = str(tmp_path / "cache")
    shutil.copytree(small_cache, cache)
    _rewrite_manifest(cache, lambda m: m.update(dtype="uint32"))
    with pytest.raises(CorruptShardError, match="uint32"), open_cache(cache) as opened:
        opened.read(0)
