from __future__ import annotations

import json
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardcache import CacheKeyMismatch
from shardcache.store.key import (
    HARD_COMPONENTS,
    CacheKey,
    compare,
    read_lock,
    verify_manifest_key,
    write_lock,
)

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 5) | st.text(max_size=5),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=3)
    ),
    max_leaves=8,
)
keys = st.fixed_dictionaries({name: json_values for name in (*HARD_COMPONENTS, "versions")})


@settings(max_examples=50, deadline=None)
@given(keys, st.sampled_from(HARD_COMPONENTS), json_values)
def test_digest_changes_iff_a_hard_component_changes(components, name, value):
    key = CacheKey(components)
    changed = key.with_component(name, value)
    same = json.dumps(components[name], sort_keys=True) == json.dumps(value, sort_keys=True)
    assert (key.digest == changed.digest) == same
    # soft components never move the digest
    assert key.with_component("versions", {"transformers": "99"}).digest == key.digest
    # a round trip through JSON keeps the digest
    assert CacheKey.from_json(json.loads(json.dumps(key.to_json()))).digest == key.digest


def test_digest_stable_across_processes():
    components = {"tokenizer": {"b": 1, "a": [1, 2]}, "data": {"mode": "version", "version": "v1"}}
    here = CacheKey(components).digest
    code = (
        "import json, sys; from shardcache.store.key import CacheKey; "
        "print(CacheKey(json.loads(sys.argv[1])).digest)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, json.dumps(components)],
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.strip() == here


def _key(**overrides):
    base = {
        "tokenizer": {"model": {"sha256": "aa"}, "normalizer": {"lowercase": True}},
        "special_tokens": {"end_id": 2},
        "behaviour": {"ids": {"ascii": [1, 2, 3]}},
        "template": {"kind": "text"},
        "truncation": {"max_length": 8, "strategy": "split", "side": "right"},
        "data": {"mode": "files", "files": {"a.jsonl": {"size": 1, "sha256": "x"}}},
        "versions": {"transformers": "5.0", "tokenizers": "0.22"},
    }
    base.update(overrides)
    return CacheKey(base)


def test_compare_names_component_and_field():
    old = _key()
    new = _key(truncation={"max_length": 16, "strategy": "split", "side": "right"})
    result = compare(old, new)
    assert not result.compatible
    assert result.status["truncation"] == "changed" and result.status["tokenizer"] == "same"
    [diff] = result.differences
    assert (diff.component, diff.field, diff.old, diff.new) == ("truncation", "max_length", 8, 16)
    assert "truncation.max_length: 8 -> 16" in result.describe()


def test_version_change_is_a_warning_unless_behaviour_changes_or_strict():
    old = _key()
    upgraded = _key(versions={"transformers": "5.9", "tokenizers": "0.22"})
    soft = compare(old, upgraded)
    assert soft.compatible and soft.status["versions"] == "warning"
    assert not compare(old, upgraded, strict=True).compatible
    drifted = _key(
        versions={"transformers": "5.9", "tokenizers": "0.22"},
        behaviour={"ids": {"ascii": [1, 2, 4]}},
    )
    result = compare(old, drifted)
    assert result.status["versions"] == "changed" and result.status["behaviour"] == "changed"


def test_lock_round_trip_and_manifest_verification(tmp_path):
    key = _key()
    path = str(tmp_path / "shardcache.lock")
    write_lock(path, key)
    assert read_lock(path).digest == key.digest
    manifest = {"key": key.to_json()}
    assert verify_manifest_key(manifest, path, "cache").digest == key.digest
    other = key.with_component(
        "truncation", {"max_length": 9, "strategy": "split", "side": "right"}
    )
    with pytest.raises(CacheKeyMismatch, match=r"truncation\.max_length") as info:
        verify_manifest_key(manifest, other, "cache")
    assert info.value.differences == [("truncation", "max_length", 8, 9)]
    # components absent on the expected side (no data given) are not compared
    verify_manifest_key(manifest, key.with_component("data", None), "cache")


def test_a_diff_names_a_value_that_became_an_object_once_and_absent_plainly():
    """Issue 51 item 8: a normalizer added to a tokenizer read ``null -> "<absent>"``."""
    old = _key(tokenizer={"normalizer": None, "model": {"type": "BPE", "dropout": 0.1}})
    new = _key(tokenizer={"normalizer": {"type": "NFC"}, "model": {"type": "BPE"}})
    result = compare(old, new)
    text = result.describe()
    assert 'tokenizer.normalizer: null -> {"type":"NFC"}' in text
    assert "tokenizer.model.dropout: 0.1 -> (absent)" in text
    assert "<absent>" not in text and len(result.differences) == 2


def test_a_recorded_template_from_is_provenance_not_key():
    """Issue 51 item 8: caches and locks recorded ``template.template_from``; the same template
    text from a file or the tokenizer is one key."""
    template = {"kind": "chat", "source": "{{ m }}", "train_on": "assistant"}
    current = _key(template=template)
    recorded = CacheKey.from_json(
        json.loads(json.dumps(_key(template={**template, "template_from": "tokenizer"}).to_json()))
    )
    assert compare(recorded, current).compatible
    assert recorded.digest == current.digest
