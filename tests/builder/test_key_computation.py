"""The key's tokenizer component is memoised on disk by the digest of its whole input: the
same value as computing it, recomputed whenever the memo is missing, damaged or unwritable."""

from __future__ import annotations

import json
import os

import pytest

from shardcache.builder import key_computation as keying
from shardcache.builder.encoders import make_encoder
from shardcache.config import TokenizeOptions
from shardcache.store.files import cache_root


@pytest.fixture()
def text(tokenizer_dir):
    return make_encoder(TokenizeOptions(tokenizer=tokenizer_dir), None)


def _direct(text, truncation=None):
    trunc = text.backend_truncation if truncation is None else truncation
    return keying.tokenizer_component(text.backend_json, trunc, text.backend_padding)


def _memo_files() -> list[str]:
    folder = os.path.join(cache_root(), keying.COMPONENTS_DIR)
    return sorted(os.listdir(folder)) if os.path.isdir(folder) else []


def test_the_memo_equals_the_component_and_is_read_back(text, monkeypatch):
    first = keying.text_component(text)
    assert first == _direct(text)
    assert len(_memo_files()) == 1

    def refuse(*_):
        raise AssertionError("computed again despite the memo")

    monkeypatch.setattr(keying, "tokenizer_component", refuse)
    assert keying.text_component(text) == first


def test_another_input_is_another_entry(text):
    plain = keying.text_component(text)
    other = keying.memoised_tokenizer_component(
        text.serialized, lambda: text.backend_json, {"max_length": 7}, text.backend_padding
    )
    assert other == _direct(text, {"max_length": 7}) and other != plain
    assert len(_memo_files()) == 2


@pytest.mark.parametrize("damage", ["garbage", "other-input", "no-value"])
def test_a_damaged_memo_is_recomputed(text, damage):
    want = keying.text_component(text)
    (name,) = _memo_files()
    path = os.path.join(cache_root(), keying.COMPONENTS_DIR, name)
    if damage == "garbage":
        content = "{not json"
    elif damage == "other-input":
        content = json.dumps({"input": "0" * 64, "value": {"model": "forged"}})
    else:
        content = json.dumps({"input": name.removesuffix(".json")})
    with open(path, "w") as f:
        f.write(content)
    assert keying.text_component(text) == want


def test_an_unusable_cache_folder_only_costs_the_computation(text, tmp_path, monkeypatch):
    blocked = tmp_path / "file-not-folder"
    blocked.write_text("x")
    monkeypatch.setenv("SHARDCACHE_CACHE_DIR", str(blocked))
    assert keying.text_component(text) == _direct(text)
