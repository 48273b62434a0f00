"""Chat data end to end: build -> shards with loss masks -> ShardDataset labels; check."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from conftest import CHATML_TEMPLATE, make_conversations, write_records
from shardcache import ShardcacheError, ShardDataset, open_cache
from shardcache.builder.chat import ChatEncoder, ChatOptions
from shardcache.builder.tokenize import TextEncoder
from shardcache.cli import main
from shardcache.config import TokenizeOptions


@pytest.fixture()
def chat_corpus(tmp_path):
    folder = tmp_path / "chat"
    folder.mkdir()
    convs = {}
    for name, fmt, seed in (("a.jsonl", "jsonl", 1), ("b.parquet", "parquet", 2)):
        records = [{"messages": m} for m in make_conversations(25, seed=seed)]
        write_records(str(folder / name), records, fmt)
        convs.update({(name, i): r["messages"] for i, r in enumerate(records)})
    return str(folder), convs


def _reference(tokenizer_dir, messages):
    encoder = ChatEncoder(
        TextEncoder(TokenizeOptions(tokenizer_dir, append_eos=False)), ChatOptions()
    )
    [sample] = encoder.encode_texts([messages])
    return sample.ids, sample.mask


def test_every_conversation_once_with_exact_ids_and_masks(
    chat_corpus, build_cache, chatml_tokenizer_dir
):
    folder, convs = chat_corpus
    cache = open_cache(build_cache(folder, chatml_tokenizer_dir, chat=True))
    assert cache.manifest["kind"] == "chat" and cache.has_mask
    seen = set()
    for seq in cache.iter_sequences():
        key = (seq.provenance.source, seq.provenance.record)
        assert key not in seen
        seen.add(key)
        ids, mask = _reference(chatml_tokenizer_dir, convs[key])
        assert seq.ids.tolist() == ids.tolist()
        assert seq.mask.tolist() == mask.tolist()
    assert seen == set(convs)
    stats = cache.manifest["stats"]
    assert stats["trainable_tokens"] == sum(int(s.mask.sum()) for s in cache.iter_sequences())
    assert stats["lint"]["template_mismatch"] == 0 and stats["lint"]["template_checked"] > 0


@pytest.mark.parametrize(
    "mode",
    [
        {},
        {"mode": "pack", "seq_len": 128, "packing": "best_fit", "attention": "mask"},
        {"mode": "pack", "seq_len": 64, "packing": "concat", "attention": "varlen"},
    ],
)
def test_labels_in_batches_follow_the_stored_mask(
    mode, chat_corpus, build_cache, chatml_tokenizer_dir
):
    folder, _ = chat_corpus
    path = build_cache(folder, chatml_tokenizer_dir, chat=True, max_length=128)
    cache = open_cache(path)
    ds = ShardDataset(path, max_tokens=1024, **mode)
    trained = 0
    for batch in ds:
        labels, ids = batch["labels"], batch["input_ids"]
        assert torch.all((labels == -100) | (labels == ids))
        trained += int((labels != -100).sum())
        if not mode:
            for row, sid in enumerate(batch["meta"]["sample_ids"].tolist()):
                mask = cache.read_masks(np.array([sid]))[0]
                n = len(mask)
                want = np.where(mask, ids[row, :n].numpy(), -100)
                assert labels[row, :n].tolist() == want.tolist()
                assert torch.all(labels[row, n:] == -100)
    total = cache.manifest["stats"]["trainable_tokens"]
    if not mode:
        assert trained == total
    else:  # packed rows also drop the first token of each segment (never a target)
        assert 0 < trained <= total


def test_bad_conversations_are_quarantined(tmp_path, build_cache, chatml_tokenizer_dir):
    path = tmp_path / "mixed.jsonl"
    good = make_conversations(3, seed=9)
    records = [
        {"messages": good[0]},
        {"messages": "not a list"},
        {"messages": [{"role": "user"}]},
        {"messages": []},
        {"text": "no messages"},
        {"messages": good[1]},
    ]
    write_records(str(path), records, "jsonl")
    out = build_cache(str(path), chatml_tokenizer_dir, chat=True, max_bad_fraction=1.0)
    cache = open_cache(out)
    assert sorted(s.provenance.record for s in cache.iter_sequences()) == [0, 5]
    assert cache.manifest["stats"]["bad_records"] == {
        "bad_message": 1,
        "empty_messages": 1,
        "messages_not_list": 1,
        "no_messages_field": 1,
    }
    with open(os.path.join(out, "quarantine.jsonl")) as f:
        quarantined = [json.loads(line) for line in f]
    assert sorted(q["record"] for q in quarantined) == [1, 2, 3, 4]


def test_strict_lint_refuses_to_commit(tmp_path, chat_corpus, chatml_tokenizer_dir):
    template = tmp_path / "no-end.jinja"  # assistant turns without an end-of-turn token
    template.write_text(
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n"
        "{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}"
    )
    folder, _ = chat_corpus
    out = str(tmp_path / "strict")
    args = [
        "build",
        "-i",
        folder,
        "-t",
        chatml_tokenizer_dir,
        "-o",
        out,
        "--chat",
        "--chat-template",
        str(template),
        "-q",
        "--workers",
        "1",
    ]
    result = CliRunner().invoke(main, [*args, "--strict-lint"])
    assert result.exit_code == 1 and "missing_end_of_turn" in result.output
    assert not os.path.exists(os.path.join(out, "manifest.json"))
    result = CliRunner().invoke(main, args)  # without --strict-lint: commits, counts shown
    assert result.exit_code == 0, result.output
    assert open_cache(out).manifest["stats"]["lint"]["missing_end_of_turn"] > 0


def test_two_workers_give_the_same_bytes(chat_corpus, build_cache, chatml_tokenizer_dir):
    folder, _ = chat_corpus
    one = build_cache(folder, chatml_tokenizer_dir, chat=True, workers=1)
    two = build_cache(folder, chatml_tokenizer_dir, chat=True, workers=2)
    for sub in ("manifest.json", "index/lengths.npy"):
        with open(os.path.join(one, sub), "rb") as a, open(os.path.join(two, sub), "rb") as b:
            assert a.read() == b.read(), sub
    names = sorted(os.listdir(os.path.join(one, "shards")))
    assert names == sorted(os.listdir(os.path.join(two, "shards")))


def test_check_names_an_edited_chat_template(tmp_path, chat_corpus, chatml_tokenizer_dir):
    template = tmp_path / "t.jinja"
    template.write_text(CHATML_TEMPLATE)
    folder, _ = chat_corpus
    recipe = tmp_path / "r.toml"
    recipe.write_text(
        f'input = "{folder}"\ntokenizer = "{chatml_tokenizer_dir}"\n'
        f'output = "{tmp_path / "c"}"\nchat = true\nchat_template = "t.jinja"\n'
        "workers = 1\n"
    )
    runner = CliRunner()
    assert runner.invoke(main, ["build", str(recipe), "-q"]).exit_code == 0
    assert runner.invoke(main, ["check", str(tmp_path / "c"), str(recipe)]).exit_code == 0
    template.write_text(CHATML_TEMPLATE.replace("<|im_end|>\n", "<|im_end|>\n\n"))
    result = runner.invoke(main, ["check", str(tmp_path / "c"), str(recipe), "--json"])
    assert result.exit_code == 1
    report = json.loads(result.stdout)
    fields = {d["field"] for d in report["components"]["template"]["differences"]}
    assert "source" in fields
    assert report["components"]["behaviour"]["status"] == "changed"  # the probe chat changed


def test_chat_options_are_validated(tmp_path, chat_corpus, chatml_tokenizer_dir):
    folder, _ = chat_corpus
    runner = CliRunner()
    args = ["build", "-i", folder, "-t", chatml_tokenizer_dir, "-o", str(tmp_path / "x"), "--chat"]
    result = runner.invoke(main, [*args, "--truncation", "split", "--max-length", "64"])
    assert result.exit_code == 2 and "split" in result.output
    with pytest.raises(ShardcacheError):
        ChatEncoder(
            TextEncoder(TokenizeOptions(chatml_tokenizer_dir)),
            ChatOptions(template_path=str(tmp_path / "missing.jinja")),
        )


def test_verify_accepts_a_chat_cache(chat_corpus, build_cache, chatml_tokenizer_dir):
    from shardcache import verify_cache

    folder, _ = chat_corpus
    report = verify_cache(build_cache(folder, chatml_tokenizer_dir, chat=True))
    assert report.ok, report.to_json()


def test_job_array_shares_then_commit_equal_the_local_chat_build(
    chat_corpus, build_cache, chatml_tokenizer_dir, tmp_path
):
    folder, _ = chat_corpus
    local = build_cache(folder, chatml_tokenizer_dir, chat=True)
    out = str(tmp_path / "shares")
    args = [
        "build",
        "-i",
        folder,
        "-t",
        chatml_tokenizer_dir,
        "-o",
        out,
        "--chat",
        "-q",
        "--workers",
        "1",
    ]
    runner = CliRunner()
    for i in range(2):
        result = runner.invoke(main, [*args, "--partition", f"{i}/2"])
        assert result.exit_code == 0, result.output
    assert runner.invoke(main, ["commit", out]).exit_code == 0
    for sub in ("manifest.json", "index/lengths.npy"):
        with open(os.path.join(local, sub), "rb") as a, open(os.path.join(out, sub), "rb") as b:
            assert a.read() == b.read(), sub


def test_commit_applies_strict_lint_to_the_shares(tmp_path, chat_corpus, chatml_tokenizer_dir):
    template = tmp_path / "no-end.jinja"
    template.write_text(
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n"
        "{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}"
    )
    folder, _ = chat_corpus
    out = str(tmp_path / "shares")
    args = [
        "build",
        "-i",
        folder,
        "-t",
        chatml_tokenizer_dir,
        "-o",
        out,
        "--chat",
        "-q",
        "--chat-template",
        str(template),
        "--workers",
        "1",
    ]
    runner = CliRunner()
    for i in range(2):
        assert runner.invoke(main, [*args, "--partition", f"{i}/2"]).exit_code == 0
    refused = runner.invoke(main, ["commit", out, "--strict-lint"])
    assert refused.exit_code == 1 and "missing_end_of_turn" in refused.output
    assert not os.path.exists(os.path.join(out, "manifest.json"))
    assert runner.invoke(main, ["commit", out]).exit_code == 0
