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


def test_more_ranks_than_batches_warns(small_cache):
    ds = ShardDataset(small_cache, max_tokens=256, rank=0, world_size=64)
    with pytest.warns(UserWarning, match=r"world_size=64.*0 batches"):
        assert len(ds) == 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert len(ShardDataset(small_cache, max_tokens=256, rank=0, world_size=1)) > 0
