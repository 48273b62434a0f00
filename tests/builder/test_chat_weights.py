"""Per-message loss weights at build time (``weight_field``): stored per token beside the mask,
validated, in the key's template component, and nothing changes for a build that does not ask."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from click.testing import CliRunner

from conftest import cache_data_files, make_chat_pairs, make_conversations, write_records
from shardcache import ShardDataset
from shardcache.cli import main
from shardcache.config import ChatOptions
from shardcache.errors import ConfigError
from shardcache.store.cache import open_cache
from shardcache.store.show import mask_runs


def _weigh(convs: list[list[dict]], weights: list[float | None]) -> list[dict]:
    """Records whose assistant turns take ``weights`` in turn (None: no weight key)."""
    out, k = [], 0
    for conv in convs:
        messages = []
        for message in conv:
            message = dict(message)
            if message["role"] == "assistant":
                if weights[k % len(weights)] is not None:
                    message["weight"] = weights[k % len(weights)]
                k += 1
            messages.append(message)
        out.append({"messages": messages})
    return out


def _by_record(path: str) -> dict[int, tuple[np.ndarray, np.ndarray, np.ndarray | None]]:
    with open_cache(path) as cache:
        ids = np.arange(cache.num_sequences)
        weights = cache.read_weights(ids) if cache.has_weights else [None] * len(ids)
        masks = cache.read_masks(ids)
        return {
            seq.provenance.record: (seq.ids, masks[seq.sample_id], weights[seq.sample_id])
            for seq in cache.iter_sequences()
        }


def test_each_trainable_turn_weighs_its_message(tmp_path, build_cache, chatml_tokenizer_dir):
    convs = make_conversations(40, seed=21)
    records = _weigh(convs, [0.5, None, 0, 1, 0.25, 0.75])
    path = write_records(str(tmp_path / "w.jsonl"), records, "jsonl")
    weighted = _by_record(build_cache(path, chatml_tokenizer_dir, chat=True,
                                      weight_field="weight"))  # fmt: skip
    plain_path = write_records(str(tmp_path / "p.jsonl"), [{"messages": c} for c in convs], "jsonl")
    plain = _by_record(build_cache(plain_path, chatml_tokenizer_dir, chat=True))
    assert set(weighted) <= set(plain) and len(weighted) > 20
    dropped = 0
    for record, (ids, mask, _) in plain.items():
        turns = [
            m.get("weight", 1.0) for m in records[record]["messages"] if m["role"] == "assistant"
        ]
        runs = [(s, e) for s, e, trainable in mask_runs(mask) if trainable]
        assert len(runs) == len(turns)  # a trainable run per assistant turn
        want = np.zeros(len(ids), np.float32)
        for (start, end), weight in zip(runs, turns):
            want[start:end] = weight
        if not want.any():  # every turn weighs 0: nothing to train on, dropped
            assert record not in weighted
            dropped += 1
            continue
        got_ids, got_mask, got_weights = weighted[record]
        assert got_ids.tolist() == ids.tolist()
        np.testing.assert_array_equal(got_weights, want)
        np.testing.assert_array_equal(got_mask, want > 0)  # a weight-0 turn is not trained
    assert dropped == len(plain) - len(weighted)


def test_without_weight_field_weights_are_ignored_and_nothing_changes(
    tmp_path, build_cache, chatml_tokenizer_dir
):
    convs = make_conversations(30, seed=22)
    plain = write_records(str(tmp_path / "p.jsonl"), [{"messages": c} for c in convs], "jsonl")
    marked = write_records(str(tmp_path / "m.jsonl"), _weigh(convs, [0, 0.5]), "jsonl")
    a = build_cache(plain, chatml_tokenizer_dir, chat=True)
    b = build_cache(marked, chatml_tokenizer_dir, chat=True)

    def shards(folder: str) -> dict[str, bytes]:  # (content keys hash whole records)
        return {k: v for k, v in cache_data_files(folder).items() if k.startswith("shards/")}

    assert shards(a) == shards(b)  # the weight keys are not read
    with open_cache(a) as cache:
        assert not cache.has_weights
        template = cache.manifest["key"]["components"]["template"]
        assert "loss_weights" not in template and "loss_weights" not in cache.manifest["tokenizer"]
    # a weighted build of data without weights: the same tokens and masks, every weight 1
    c = _by_record(build_cache(plain, chatml_tokenizer_dir, chat=True, weight_field="weight"))
    for record, (ids, mask, _) in _by_record(a).items():
        assert c[record][0].tolist() == ids.tolist()
        np.testing.assert_array_equal(c[record][2], mask.astype(np.float32))


def test_the_key_changes_with_a_weight_and_with_the_option(
    tmp_path, build_cache, chatml_tokenizer_dir
):
    convs = make_conversations(10, seed=23)
    first = _weigh(convs, [0.5, 1])
    second = json.loads(json.dumps(first))
    turn = next(m for m in second[3]["messages"] if m["role"] == "assistant")
    turn["weight"] = 0.25
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    one = write_records(str(tmp_path / "a" / "r.jsonl"), first, "jsonl")
    two = write_records(str(tmp_path / "b" / "r.jsonl"), second, "jsonl")
    keys = []
    for path, field in ((one, "weight"), (two, "weight"), (one, None)):
        options = {"weight_field": field} if field else {}
        with open_cache(build_cache(path, chatml_tokenizer_dir, chat=True, **options)) as cache:
            keys.append(cache.manifest["key"])
    assert len({key["digest"] for key in keys}) == 3
    assert keys[0]["components"]["data"] != keys[1]["components"]["data"]
    assert keys[0]["components"]["template"] == keys[1]["components"]["template"]
    assert keys[0]["components"]["template"]["loss_weights"]["field"] == "weight"
    without = dict(keys[0]["components"]["template"])
    without.pop("loss_weights")
    assert without == keys[2]["components"]["template"]  # only the weight policy differs


def test_bad_weights_are_quarantined(tmp_path, build_cache, chatml_tokenizer_dir):
    good = make_conversations(7, seed=24)
    bad_values = [2, -0.5, "1", True, [1]]
    records = []
    for conv, value in zip(good, [*bad_values, None, 0.5]):
        conv = [dict(m) for m in conv]
        conv[-1]["weight"] = value
        records.append({"messages": conv})
    path = tmp_path / "bad.jsonl"
    lines = [json.dumps(r) for r in records]
    lines.append(lines[-1].replace('"weight": 0.5', '"weight": NaN'))
    lines.append(lines[-2].replace('"weight": 0.5', '"weight": Infinity'))
    path.write_text("\n".join(lines) + "\n")
    out = build_cache(str(path), chatml_tokenizer_dir, chat=True, weight_field="weight",
                      max_bad_fraction=1.0)  # fmt: skip
    with open_cache(out) as cache:
        kept = sorted(s.provenance.record for s in cache.iter_sequences())
        bad = cache.manifest["stats"]["bad_records"]
    assert kept == [5, 6]  # (None weighs 1)
    assert bad == {"bad_weight": 7}
    with open(os.path.join(out, "quarantine.jsonl")) as f:
        quarantined = [json.loads(line) for line in f]
    assert sorted(q["record"] for q in quarantined) == [0, 1, 2, 3, 4, 7, 8]
    assert all(q["reason"] == "bad_weight" and "[0, 1]" in q["excerpt"] for q in quarantined)


def test_weight_field_options_are_checked(tmp_path, chatml_tokenizer_dir):
    with pytest.raises(ConfigError, match="train_on = 'all'"):
        ChatOptions(train_on="all", weight_field="weight")
    with pytest.raises(ConfigError, match="weight_field"):
        ChatOptions(weight_field="")


def test_the_cli_flag_and_check(tmp_path, chatml_tokenizer_dir):
    records = _weigh(make_conversations(12, seed=25), [0.5, 1])
    path = write_records(str(tmp_path / "c.jsonl"), records, "jsonl")
    recipe = tmp_path / "r.toml"
    recipe.write_text(
        f'input = "{path}"\ntokenizer = "{chatml_tokenizer_dir}"\n'
        f'output = "{tmp_path / "c"}"\nchat = true\nworkers = 1\n'
    )
    runner = CliRunner()
    result = runner.invoke(main, ["build", str(recipe), "--weight-field", "weight", "-q"])
    assert result.exit_code == 0, result.output
    assert open_cache(str(tmp_path / "c")).has_weights
    result = runner.invoke(main, ["check", str(tmp_path / "c"), str(recipe), "--json"])
    assert result.exit_code == 1  # the recipe does not read the weights
    report = json.loads(result.stdout)
    fields = {d["field"] for d in report["components"]["template"]["differences"]}
    assert fields == {"loss_weights"}
    recipe.write_text(recipe.read_text() + 'weight_field = "weight"\n')
    assert runner.invoke(main, ["check", str(tmp_path / "c"), str(recipe)]).exit_code == 0


def test_preference_pairs_carry_weights(tmp_path, build_cache, chatml_tokenizer_dir):
    pairs = make_chat_pairs(30, seed=26)
    for k, pair in enumerate(pairs):
        pair["chosen"][0]["weight"] = 0.5
        pair["rejected"][0]["weight"] = [1, 0.25, 0][k % 3]
    path = write_records(str(tmp_path / "pairs.jsonl"), pairs, "jsonl")
    out = build_cache(path, chatml_tokenizer_dir, kind="preference", weight_field="weight")
    with open_cache(out) as cache:
        assert cache.is_preference and cache.has_weights
        weights = cache.read_weights(np.arange(cache.num_sequences))
        records = [s.provenance.record for s in cache.iter_sequences()]
        assert cache.manifest["stats"]["dropped_no_trainable"] == 10  # a rejected side weighs 0
    assert len(weights) == 40
    for side, (record, w) in enumerate(zip(records, weights)):
        want = 0.5 if side % 2 == 0 else [1, 0.25, 0][record % 3]
        assert set(np.unique(w).tolist()) == {0.0, want}
    batch = next(iter(ShardDataset(out, max_tokens=512)))
    assert batch["loss_weights"].shape == batch["labels"].shape
    assert ((batch["labels"] == -100) == (batch["loss_weights"] == 0)).all()


def test_merged_and_compressed_shards_keep_their_weights(tmp_path, build_cache,
                                                         chatml_tokenizer_dir):  # fmt: skip
    from shardcache import verify_cache

    folder = tmp_path / "chat"
    folder.mkdir()
    weights = {}
    for f in range(4):
        records = _weigh(make_conversations(20, seed=30 + f), [0.5, 1, 0.25])
        write_records(str(folder / f"c{f}.jsonl"), records, "jsonl")
        alone = build_cache(str(folder / f"c{f}.jsonl"), chatml_tokenizer_dir, chat=True,
                            weight_field="weight")  # fmt: skip
        for record, (_, _, w) in _by_record(alone).items():
            weights[(f"c{f}.jsonl", record)] = w.tolist()
    out = build_cache(str(folder), chatml_tokenizer_dir, chat=True, weight_field="weight",
                      compression="zstd")  # fmt: skip
    with open_cache(out) as cache:
        assert any("sources" in s for s in cache.shards)  # partial shards were merged
        got = cache.read_weights(np.arange(cache.num_sequences))
        seen = {
            (s.provenance.source, s.provenance.record): got[s.sample_id].tolist()
            for s in cache.iter_sequences()
        }
    assert seen == weights
    report = verify_cache(out)
    assert report.ok, report.problems
