"""Preference pairs end to end: build -> two masked rows per pair, adjacent, chosen first."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer

import conftest
from conftest import WORDS, make_chat_pairs, make_conversations, write_records
from shardcache import open_cache
from shardcache.builder.chat import ChatRenderer
from shardcache.config import ChatOptions


def make_string_pairs(n: int, seed: int = 0) -> list[dict[str, str]]:
    """String pairs with completions of at most 10 words (fits this module's limits)."""
    return conftest.make_string_pairs(n, seed, longest=10)


def _by_sample_id(cache) -> list:
    return sorted(cache.iter_sequences(), key=lambda s: s.sample_id)


def test_string_pairs_two_rows_each_chosen_first_completion_trained(
    tmp_path, build_cache, tokenizer_dir
):
    records = make_string_pairs(60, seed=1)
    path = write_records(str(tmp_path / "pairs.jsonl"), records, "jsonl")
    cache = open_cache(build_cache(path, tokenizer_dir, kind="preference", buckets=[16, 32]))
    assert cache.manifest["kind"] == "preference" and cache.is_preference
    assert cache.manifest["key"]["components"]["template"]["kind"] == "preference"
    assert cache.num_sequences == 2 * len(records)
    backend = Tokenizer.from_file(f"{tokenizer_dir}/tokenizer.json")
    eos = cache.manifest["tokenizer"]["eos_id"]
    seqs = _by_sample_id(cache)
    for k in range(len(records)):
        chosen, rejected = seqs[2 * k], seqs[2 * k + 1]
        assert chosen.provenance.record == rejected.provenance.record
        assert (chosen.provenance.piece, rejected.provenance.piece) == (0, 1)
        record = records[chosen.provenance.record]
        prompt = backend.encode(record["prompt"], add_special_tokens=False).ids
        for seq, side in ((chosen, "chosen"), (rejected, "rejected")):
            completion = [*backend.encode(record[side], add_special_tokens=False).ids, eos]
            assert seq.ids.tolist() == prompt + completion
            assert seq.mask.tolist() == [False] * len(prompt) + [True] * len(completion)
    stats = cache.manifest["stats"]
    assert stats["documents"] == len(records) and stats["sequences"] == 2 * len(records)


def test_chat_pairs_train_only_the_completion(tmp_path, build_cache, chatml_tokenizer_dir):
    records = make_chat_pairs(30, seed=3)
    path = write_records(str(tmp_path / "pairs.jsonl"), records, "jsonl")
    cache = open_cache(build_cache(path, chatml_tokenizer_dir, kind="preference"))
    backend = Tokenizer.from_file(f"{chatml_tokenizer_dir}/tokenizer.json")
    from transformers import AutoTokenizer

    renderer = ChatRenderer(AutoTokenizer.from_pretrained(chatml_tokenizer_dir), ChatOptions())
    seqs = _by_sample_id(cache)
    assert len(seqs) == 2 * len(records)
    for seq in seqs:
        record = records[seq.provenance.record]
        side = ("chosen", "rejected")[seq.provenance.piece]
        full = renderer.render_texts([record["prompt"] + record[side]])[0]
        start = len(renderer.render_texts([record["prompt"]])[0]) if record["prompt"] else 0
        # the template ends the turn: no EOS appended to message lists (as chat data, and TRL)
        assert seq.ids.tolist() == backend.encode(full, add_special_tokens=False).ids
        trained = seq.ids[seq.mask].tolist()
        # the completion's content and end of turn are trained, nothing of the prompt
        completion = full[start:]
        assert backend.decode(trained, skip_special_tokens=False).strip() in completion
        assert not seq.mask[: len(backend.encode(full[:start], add_special_tokens=False).ids)].any()


def test_a_pair_with_one_side_over_max_length_is_dropped_whole(
    tmp_path, build_cache, tokenizer_dir
):
    records = make_string_pairs(40, seed=2)
    records[5]["rejected"] = " " + " ".join(["hello"] * 200)
    path = write_records(str(tmp_path / "pairs.jsonl"), records, "jsonl")
    cache = open_cache(build_cache(path, tokenizer_dir, kind="preference", max_length=64))
    kept = {s.provenance.record for s in cache.iter_sequences()}
    assert 5 not in kept and len(kept) == len(records) - 1
    assert cache.num_sequences == 2 * len(kept)
    stats = cache.manifest["stats"]
    assert stats["dropped_documents"] == 1 and stats["lost_tokens"] > 200
    seqs = _by_sample_id(cache)
    assert all(len(s.ids) <= 64 for s in seqs)


def test_pairs_stay_adjacent_across_buckets_and_shard_cuts(tmp_path, build_cache, tokenizer_dir):
    records = make_string_pairs(1500, seed=4)
    path = write_records(str(tmp_path / "pairs.jsonl"), records, "jsonl")
    out = build_cache(path, tokenizer_dir, kind="preference", buckets=[12, 20],
                      shard_size="4KiB")  # fmt: skip
    cache = open_cache(out)
    assert len(cache.manifest["shards"]) > 3
    assert all(s["rows"] % 2 == 0 for s in cache.manifest["shards"])
    seqs = _by_sample_id(cache)
    for k in range(0, len(seqs), 2):
        assert seqs[k].provenance.record == seqs[k + 1].provenance.record
        assert (seqs[k].provenance.piece, seqs[k + 1].provenance.piece) == (0, 1)


def test_bad_pairs_are_quarantined(tmp_path, build_cache, tokenizer_dir):
    good = make_string_pairs(2, seed=5)
    records = [
        good[0],
        {"prompt": "p", "chosen": "c"},
        {"prompt": "p", "chosen": [{"role": "assistant", "content": "x"}], "rejected": "r"},
        {"prompt": "p", "chosen": "", "rejected": "r"},
        good[1],
    ]
    path = write_records(str(tmp_path / "pairs.jsonl"), records, "jsonl")
    cache = open_cache(build_cache(path, tokenizer_dir, kind="preference", max_bad_fraction=1.0))
    assert sorted({s.provenance.record for s in cache.iter_sequences()}) == [0, 4]
    assert cache.manifest["stats"]["bad_records"] == {
        "no_preference_field": 1, "mixed_preference_types": 1, "empty_completion": 1,
    }  # fmt: skip


@pytest.mark.parametrize(
    "values",
    [
        {"truncation": "split"},
        {"train_on": "all"},
        {"truncation_side": "left"},
        {"max_prompt_length": 8, "max_length": 8},
        {"max_prompt_length": 8, "train_on": "last-assistant"},
    ],
)
def test_preference_refuses_options_that_would_break_pairs(values, tmp_path, build_cache,
                                                           tokenizer_dir):  # fmt: skip
    from shardcache import ConfigError

    path = write_records(str(tmp_path / "p.jsonl"), make_string_pairs(2), "jsonl")
    with pytest.raises(ConfigError, match=next(iter(values))):
        build_cache(path, tokenizer_dir, kind="preference", **values)


def test_cli_preference_flag_builds_a_preference_cache(tmp_path, tokenizer_dir):
    from click.testing import CliRunner

    from shardcache.cli import main

    path = write_records(str(tmp_path / "p.jsonl"), make_string_pairs(5), "jsonl")
    out = str(tmp_path / "cache")
    args = ["build", "--input", path, "--tokenizer", tokenizer_dir, "--output", out]
    result = CliRunner().invoke(main, [*args, "--preference", "--workers", "1"])
    assert result.exit_code == 0, result.output
    assert open_cache(out).num_sequences == 10


def _rows(cache) -> list[tuple[int, int, list[int], list[bool]]]:
    return [(s.provenance.record, s.provenance.piece, s.ids.tolist(), s.mask.tolist())
            for s in _by_sample_id(cache)]  # fmt: skip


@pytest.mark.parametrize("tokenizer", ["chatml_tokenizer_dir", "inst_tokenizer_dir"])
def test_implicit_prompt_conversations_equal_the_explicit_shape(tokenizer, tmp_path, build_cache,
                                                                request):  # fmt: skip
    """TRL's implicit-prompt shape: whole conversations sharing a prefix give the ids and
    masks of the explicit ``{prompt, chosen, rejected}`` record, byte for byte."""
    folder = request.getfixturevalue(tokenizer)
    explicit = make_chat_pairs(40, seed=11)  # prompts of 1 to 3 turns, some with a system turn
    assert any(sum(m["role"] == "assistant" for m in r["prompt"]) for r in explicit)
    implicit = [{"chosen": r["prompt"] + r["chosen"], "rejected": r["prompt"] + r["rejected"]}
                for r in explicit]  # fmt: skip
    a = write_records(str(tmp_path / "explicit.jsonl"), explicit, "jsonl")
    b = write_records(str(tmp_path / "implicit.jsonl"), implicit, "jsonl")
    one = open_cache(build_cache(a, folder, kind="preference"))
    two = open_cache(build_cache(b, folder, kind="preference"))
    assert one.num_sequences == two.num_sequences == 2 * len(explicit)
    assert _rows(one) == _rows(two)
    assert one.manifest["stats"]["trainable_tokens"] == two.manifest["stats"]["trainable_tokens"]


def test_implicit_prompt_strings_split_at_the_common_character_prefix(
    tmp_path, build_cache, tokenizer_dir
):
    """Strings: TRL's ``extract_prompt``: the longest common character prefix, the space
    before the first difference going to the completions; it may end inside a word."""
    from shardcache.builder.preference import split_implicit_prompt

    texts = [
        ("The sky is blue.", "The sky is green.", ("The sky is", " blue.", " green.")),
        ("The answer is four", "The answer is five", ("The answer is f", "our", "ive")),
        ("data shard cache", "data token", ("data", " shard cache", " token")),
    ]
    for chosen, rejected, split in texts:
        assert split_implicit_prompt(chosen, rejected) == (split, None)
    implicit = [{"chosen": c, "rejected": r} for c, r, _ in texts]
    explicit = [dict(zip(("prompt", "chosen", "rejected"), s)) for _, _, s in texts]
    a = write_records(str(tmp_path / "explicit.jsonl"), explicit, "jsonl")
    b = write_records(str(tmp_path / "implicit.jsonl"), implicit, "jsonl")
    one = open_cache(build_cache(a, tokenizer_dir, kind="preference"))
    two = open_cache(build_cache(b, tokenizer_dir, kind="preference"))
    assert _rows(one) == _rows(two) and len(_rows(two)) == 6
    backend = Tokenizer.from_file(f"{tokenizer_dir}/tokenizer.json")
    eos = two.manifest["tokenizer"]["eos_id"]
    for seq in _by_sample_id(two):
        completion = explicit[seq.provenance.record][("chosen", "rejected")[seq.provenance.piece]]
        want = [*backend.encode(completion, add_special_tokens=False).ids, eos]
        assert seq.ids[seq.mask].tolist() == want


def test_implicit_prompt_records_that_are_not_pairs_are_quarantined(
    tmp_path, build_cache, chatml_tokenizer_dir
):
    def user(text: str) -> dict[str, str]:
        return {"role": "user", "content": text}

    def bot(text: str) -> dict[str, str]:
        return {"role": "assistant", "content": text}

    good = {"chosen": [user("q"), bot("yes")], "rejected": [user("q"), bot("no")]}
    records = [
        good,
        {"chosen": [user("q"), bot("yes")], "rejected": [user("other"), bot("no")]},
        {"chosen": [user("q"), bot("yes"), user("more?")], "rejected": [user("q"), bot("no")]},
        {
            "chosen": [user("q"), bot("a"), user("x"), bot("b")],
            "rejected": [user("q"), bot("a"), user("y"), bot("c")],
        },
        {"chosen": [user("q"), bot("yes")], "rejected": [user("q"), bot("yes")]},
        {"chosen": [user("q")], "rejected": [user("q"), bot("no")]},
        {"chosen": "text", "rejected": [user("q"), bot("no")]},
        {"chosen": "same start, then this", "rejected": "other"},
        {"chosen": [user("q"), {"role": "assistant"}], "rejected": [user("q"), bot("no")]},
        {"rejected": [user("q"), bot("no")]},
        good,
    ]
    path = write_records(str(tmp_path / "pairs.jsonl"), records, "jsonl")
    cache = open_cache(build_cache(path, chatml_tokenizer_dir, kind="preference",
                                   max_bad_fraction=1.0))  # fmt: skip
    assert sorted({s.provenance.record for s in cache.iter_sequences()}) == [0, 10]
    assert cache.manifest["stats"]["bad_records"] == {
        "no_shared_prompt": 2, "last_not_assistant": 1, "divergence_not_assistant": 1,
        "empty_completion": 2, "mixed_preference_types": 1, "bad_message": 1,
        "no_preference_field": 1,
    }  # fmt: skip


def test_max_prompt_length_is_for_preference_data_only(tmp_path, build_cache, tokenizer_dir):
    from shardcache import ConfigError

    path = write_records(str(tmp_path / "t.jsonl"), [{"text": "a b c"}], "jsonl")
    with pytest.raises(ConfigError, match=r"max_prompt_length: .*preference pairs only"):
        build_cache(path, tokenizer_dir, max_prompt_length=8)
    with pytest.raises(ConfigError, match=r"max_prompt_length: .*preference pairs only"):
        build_cache(path, tokenizer_dir, chat=True, max_prompt_length=8)


def _long_string_pairs(n: int, seed: int) -> list[dict[str, str]]:
    rng = random.Random(seed)
    return [
        {
            "prompt": " ".join(rng.choices(WORDS, k=rng.randint(1, 30))),
            "chosen": " " + " ".join(rng.choices(WORDS, k=rng.randint(1, 30))),
            "rejected": " " + " ".join(rng.choices(WORDS, k=rng.randint(1, 30))),
        }
        for _ in range(n)
    ]


@pytest.mark.parametrize("tokenizer", ["tokenizer_dir", "bos_tokenizer_dir"])
def test_truncated_string_pairs_keep_the_prompt_end_and_the_completion_start(
    tokenizer, tmp_path, build_cache, request
):
    """TRL's DPO truncation: the prompt keeps its last ``max_prompt_length`` tokens, each
    completion the first ``max_length - prompt``; the trainable tokens of every pair are the
    tokenizer's ids of its kept completions, and the report counts what was cut."""
    folder = request.getfixturevalue(tokenizer)
    records = _long_string_pairs(80, seed=31)
    path = write_records(str(tmp_path / "pairs.jsonl"), records, "jsonl")
    limits = {"max_prompt_length": 12, "max_length": 30}
    cache = open_cache(build_cache(path, folder, kind="preference", truncation="truncate",
                                   **limits))  # fmt: skip
    backend = Tokenizer.from_file(f"{folder}/tokenizer.json")
    bos = [] if tokenizer == "tokenizer_dir" else [backend.token_to_id("<bos>")]
    eos = cache.manifest["tokenizer"]["eos_id"]
    seqs = _by_sample_id(cache)
    assert len(seqs) == 2 * len(records)  # nothing dropped: every pair fits once cut
    truncated = lost = 0
    for k, record in enumerate(records):
        prompt = bos + backend.encode(record["prompt"], add_special_tokens=False).ids
        kept_prompt = prompt[-12:]
        cut = False
        for piece, side in enumerate(("chosen", "rejected")):
            seq = seqs[2 * k + piece]
            assert (seq.provenance.record, seq.provenance.piece) == (k, piece)
            completion = [*backend.encode(record[side], add_special_tokens=False).ids, eos]
            kept = completion[: 30 - len(kept_prompt)]
            assert seq.ids.tolist() == kept_prompt + kept
            assert seq.ids[seq.mask].tolist() == kept  # only completion tokens trainable
            assert not seq.mask[: len(kept_prompt)].any()
            lost += len(prompt) + len(completion) - len(seq.ids)
            cut |= len(seq.ids) < len(prompt) + len(completion)
        truncated += cut
    stats = cache.manifest["stats"]
    assert truncated > 10 and stats["truncated_documents"] == truncated
    assert stats["lost_tokens"] == lost and stats["dropped_documents"] == 0
    assert cache.manifest["key"]["components"]["truncation"]["max_prompt_length"] == 12


def test_dropping_is_the_default_for_pairs_over_either_limit(tmp_path, build_cache,
                                                             tokenizer_dir):  # fmt: skip
    records = _long_string_pairs(60, seed=32)
    path = write_records(str(tmp_path / "pairs.jsonl"), records, "jsonl")
    cache = open_cache(build_cache(path, tokenizer_dir, kind="preference", max_prompt_length=10,
                                   max_length=40))  # fmt: skip
    backend = Tokenizer.from_file(f"{tokenizer_dir}/tokenizer.json")

    def length(text: str) -> int:
        return len(backend.encode(text, add_special_tokens=False).ids)

    fits = [
        k for k, r in enumerate(records)
        if length(r["prompt"]) <= 10
        and length(r["prompt"]) + max(length(r["chosen"]), length(r["rejected"])) + 1 <= 40
    ]  # fmt: skip
    assert 0 < len(fits) < len(records)
    assert sorted({s.provenance.record for s in cache.iter_sequences()}) == fits
    stats = cache.manifest["stats"]
    assert stats["dropped_documents"] == len(records) - len(fits)
    assert stats["truncated_documents"] == 0


@pytest.mark.parametrize("truncation", ["drop", "truncate"])
def test_a_pair_with_a_side_without_trainable_token_is_dropped_no_trainable(
    truncation, tmp_path, build_cache, chatml_tokenizer_dir
):
    """A side whose completion has no assistant turn has no trainable token: the pair is
    counted in ``dropped_no_trainable`` (as a chat build counts such a conversation), not in
    ``dropped_documents``, even though its whole side is longer than ``max_prompt_length``
    (a side's prompt is every token before its first trainable one)."""
    records = make_chat_pairs(20, seed=39)
    records[3]["chosen"] = [{"role": "user", "content": " ".join(["hello world"] * 30)}]
    path = write_records(str(tmp_path / "pairs.jsonl"), records, "jsonl")
    whole = open_cache(build_cache(path, chatml_tokenizer_dir, kind="preference"))
    assert whole.manifest["stats"]["dropped_no_trainable"] == 1
    longest_prompt = max(int(s.mask.argmax()) for s in whole.iter_sequences())
    limits = {"max_prompt_length": longest_prompt, "max_length": 1024, "truncation": truncation}
    cache = open_cache(build_cache(path, chatml_tokenizer_dir, kind="preference", **limits))
    assert sorted({s.provenance.record for s in cache.iter_sequences()}) == [
        k for k in range(20) if k != 3
    ]
    stats = cache.manifest["stats"]
    assert (stats["dropped_no_trainable"], stats["dropped_documents"]) == (1, 0)
    assert stats["truncated_documents"] == 0
    assert stats["lost_tokens"] == whole.manifest["stats"]["lost_tokens"] > 60


def test_truncated_chat_pairs_match_the_untruncated_pairs_cut_by_the_rule(
    tmp_path, build_cache, chatml_tokenizer_dir
):
    """Message lists: each side is the untruncated side with its prompt (every token before
    the first trainable one) cut to its last ``max_prompt_length`` tokens, then cut to
    ``max_length``; a pair's two prompts are cut alike."""
    records = make_chat_pairs(60, seed=33)
    path = write_records(str(tmp_path / "pairs.jsonl"), records, "jsonl")

    def by_record(cache) -> list:
        seqs = cache.iter_sequences()
        return sorted(seqs, key=lambda s: (s.provenance.record, s.provenance.piece))

    whole = by_record(open_cache(build_cache(path, chatml_tokenizer_dir, kind="preference")))
    limits = {"truncation": "truncate", "max_prompt_length": 16, "max_length": 28}
    cut = open_cache(build_cache(path, chatml_tokenizer_dir, kind="preference", **limits))
    got = by_record(cut)
    assert len(got) == len(whole)
    truncated = 0
    for k in range(0, len(whole), 2):
        pair_cut = False
        for a, b in ((whole[k], got[k]), (whole[k + 1], got[k + 1])):
            assert a.provenance == b.provenance
            prompt = int(a.mask.argmax())
            start = max(0, prompt - 16)
            assert b.ids.tolist() == a.ids[start : start + 28].tolist()
            assert b.mask.tolist() == a.mask[start : start + 28].tolist()
            pair_cut |= len(b.ids) < len(a.ids)
        truncated += pair_cut
        assert whole[k].ids[: whole[k].mask.argmax()].tolist() == (
            whole[k + 1].ids[: whole[k + 1].mask.argmax()].tolist()
        )  # the two sides share their prompt tokens
    assert truncated > 10 and cut.manifest["stats"]["truncated_documents"] == truncated


def test_cli_max_prompt_length(tmp_path, tokenizer_dir):
    from click.testing import CliRunner

    from shardcache.cli import main

    path = write_records(str(tmp_path / "p.jsonl"), _long_string_pairs(20, seed=34), "jsonl")
    out = str(tmp_path / "cache")
    args = ["build", "-i", path, "-t", tokenizer_dir, "-o", out, "-w", "1", "-q"]
    limits = ["--max-prompt-length", "6", "--max-length", "20"]
    result = CliRunner().invoke(main, [*args, *limits])
    assert result.exit_code == 2 and "preference pairs only" in result.output
    result = CliRunner().invoke(main, [*args, *limits, "--preference", "--truncation", "truncate"])
    assert result.exit_code == 0, result.output
    cache = open_cache(out)
    assert cache.manifest["options"]["chat"]["max_prompt_length"] == 6
    assert cache.num_sequences == 40 and max(len(s.ids) for s in cache.iter_sequences()) <= 20
    info = CliRunner().invoke(main, ["info", out])
    assert "max_length=20 strategy=truncate max_prompt_length=6" in info.output


@pytest.mark.parametrize("fmt", ["parquet", "feather"])
def test_columnar_pairs_build_the_jsonl_cache(fmt, tmp_path, build_cache, chatml_tokenizer_dir):
    """Parquet and Arrow files: a pair is a row of the prompt, chosen and rejected columns (or
    chosen and rejected alone: the implicit prompt); a file without them has only bad rows."""
    import pyarrow as pa
    import pyarrow.feather as feather

    def write(name: str, records: list[dict]) -> str:
        path = str(tmp_path / f"{name}.{fmt}")
        if fmt == "parquet":
            return write_records(path, records, "parquet")
        feather.write_feather(pa.Table.from_pylist(records), path, chunksize=7)
        return path

    records = make_chat_pairs(20, seed=35)
    implicit = [{"chosen": r["prompt"] + r["chosen"], "rejected": r["prompt"] + r["rejected"],
                 "id": k} for k, r in enumerate(records)]  # fmt: skip
    reference = _rows(open_cache(build_cache(
        write_records(str(tmp_path / "pairs.jsonl"), records, "jsonl"), chatml_tokenizer_dir,
        kind="preference")))  # fmt: skip
    for rows in (records, implicit):
        built = build_cache(write(f"pairs-{len(rows[0])}", rows), chatml_tokenizer_dir,
                            kind="preference", batch_docs=6)  # fmt: skip
        assert _rows(open_cache(built)) == reference
    strings = make_string_pairs(12, seed=36)
    strings_cache = open_cache(build_cache(write("strings", strings), chatml_tokenizer_dir,
                                           kind="preference"))  # fmt: skip
    assert strings_cache.num_sequences == 24
    from shardcache.errors import SourceError

    with pytest.raises(SourceError, match="no_preference_field: 12"):
        build_cache(write("no-rejected", [{"prompt": r["prompt"], "chosen": r["chosen"]}
                                          for r in strings]), chatml_tokenizer_dir,
                    kind="preference")  # fmt: skip


@pytest.mark.parametrize("fmt", ["csv", "tsv"])
def test_delimited_pairs_build_the_jsonl_cache(fmt, tmp_path, build_cache, tokenizer_dir):
    """CSV and TSV files: a pair is a row of the prompt, chosen and rejected columns (strings),
    or of chosen and rejected alone (the implicit prompt), built as the same records in JSON
    lines; other columns are ignored. A short row or an empty side is a bad row, as in JSON
    lines, and a file without the chosen or rejected column has only bad rows."""
    import csv

    def write(name: str, header: list[str], rows: list[list]) -> str:
        path = tmp_path / f"{name}.{fmt}"
        with open(path, "w", encoding="utf-8", newline="") as f:
            writer = csv.writer(f, delimiter="," if fmt == "csv" else "\t")
            writer.writerow(header)
            writer.writerows(rows)
        return str(path)

    def built(path: str, **options) -> list:
        return _rows(open_cache(build_cache(path, tokenizer_dir, kind="preference", **options)))

    records = make_string_pairs(30, seed=40)
    records[2]["chosen"] = ' a "quoted", two-line\n\tanswer'
    jsonl = write_records(str(tmp_path / "pairs.jsonl"), records, "jsonl")
    header = ["id", "rejected", "prompt", "chosen"]
    rows = [[k, r["rejected"], r["prompt"], r["chosen"]] for k, r in enumerate(records)]
    assert built(write("explicit", header, rows), batch_docs=7) == built(jsonl)
    implicit = [{"chosen": r["prompt"] + r["chosen"], "rejected": r["prompt"] + r["rejected"]}
                for r in records]  # fmt: skip
    reference = built(write_records(str(tmp_path / "implicit.jsonl"), implicit, "jsonl"))
    rows = [[r["chosen"], r["rejected"]] for r in implicit]
    assert len(reference) > 40  # (a side that is the other's prefix is a bad record)
    assert built(write("implicit", ["chosen", "rejected"], rows)) == reference
    rows = [[0, "r", "p", "c"], [1, "r", "p"], [2, "", "p", "c"], [3, "r", "p", "c"]]
    bad = write("bad", header, rows)  # row 1 has no chosen cell, row 2 an empty rejected
    cache = open_cache(build_cache(bad, tokenizer_dir, kind="preference", max_bad_fraction=1.0))
    assert sorted({s.provenance.record for s in cache.iter_sequences()}) == [0, 3]
    assert cache.manifest["stats"]["bad_records"] == {
        "no_preference_field": 1, "empty_completion": 1,
    }  # fmt: skip
    from shardcache.errors import SourceError

    with pytest.raises(SourceError, match="no_preference_field: 30"):
        build_cache(write("no-rejected", ["prompt", "chosen"],
                          [[r["prompt"], r["chosen"]] for r in records]),
                    tokenizer_dir, kind="preference")  # fmt: skip


@pytest.mark.slow  # importing trl takes 6-15 s
def test_implicit_prompt_split_is_trls_extract_prompt():
    """Where both accept a record, the split is TRL's ``extract_prompt``'s, for texts (a
    character prefix, ending inside a word or before a space) and conversations. Where one
    side is the other's prefix, TRL leaves the last shared character (or message) to the
    completions (its loop runs out); such a record is quarantined here."""
    trl = pytest.importorskip("trl.data_utils")
    from shardcache.builder.preference import split_implicit_prompt

    rng = random.Random(37)
    pairs = []
    for _ in range(300):
        shared = " ".join(rng.choices(WORDS, k=rng.randint(1, 6)))
        shared = shared[: rng.randint(1, len(shared))]  # may end inside a word or on a space
        pairs.append((shared + " ".join(rng.choices(WORDS, k=rng.randint(1, 4))),
                      shared + " ".join(rng.choices(WORDS, k=rng.randint(1, 4)))))  # fmt: skip
    for conv in make_conversations(100, seed=38):
        other = {"role": "assistant", "content": " ".join(rng.choices(WORDS, k=3))}
        pairs.append((conv, [*conv[:-1], other]))
    accepted = 0
    for chosen, rejected in pairs:
        split, reason = split_implicit_prompt(chosen, rejected)
        theirs = trl.extract_prompt({"chosen": chosen, "rejected": rejected})
        if split is None:  # TRL's has an empty part, or one side is the other's prefix
            assert reason in ("empty_completion", "no_shared_prompt")
            n = min(len(chosen), len(rejected))
            assert not all(theirs.values()) or chosen[:n] == rejected[:n]
            continue
        accepted += 1
        assert split == (theirs["prompt"], theirs["chosen"], theirs["rejected"])
    assert accepted > 350


@pytest.mark.parametrize("shape", ["strings", "messages"])
def test_pairs_with_identical_sides_are_quarantined_unless_kept(
    shape, tmp_path, build_cache, tokenizer_dir, chatml_tokenizer_dir
):
    """chosen == rejected teaches nothing (a DPO loss of ln 2 whatever the model): such a pair
    is a bad record ``identical_sides``; ``keep_identical_pairs`` (``--keep-identical-pairs``)
    keeps it, and only then is the policy part of the cache key."""
    if shape == "strings":
        good = make_string_pairs(2, seed=5)
        same = {"prompt": "p", "chosen": " same words", "rejected": " same words"}
        tokenizer = tokenizer_dir
    else:
        good = make_chat_pairs(2, seed=5)
        turn = [{"role": "assistant", "content": "same words"}]
        same = {"prompt": good[0]["prompt"], "chosen": turn, "rejected": list(turn)}
        tokenizer = chatml_tokenizer_dir
    path = write_records(str(tmp_path / "pairs.jsonl"), [good[0], same, good[1]], "jsonl")
    cache = open_cache(build_cache(path, tokenizer, kind="preference", max_bad_fraction=1.0))
    assert sorted({s.provenance.record for s in cache.iter_sequences()}) == [0, 2]
    assert cache.manifest["stats"]["bad_records"] == {"identical_sides": 1}
    kept = open_cache(build_cache(path, tokenizer, kind="preference", keep_identical_pairs=True))
    assert sorted({s.provenance.record for s in kept.iter_sequences()}) == [0, 1, 2]
    assert not kept.manifest["stats"].get("bad_records")
    assert kept.manifest["key"]["digest"] != cache.manifest["key"]["digest"]


def test_keep_identical_pairs_is_for_preference_data_only(tmp_path, build_cache, tokenizer_dir):
    from click.testing import CliRunner

    from shardcache import ConfigError
    from shardcache.cli import main

    path = write_records(str(tmp_path / "t.jsonl"), [{"text": "a b"}], "jsonl")
    with pytest.raises(ConfigError, match=r"keep_identical_pairs: .*preference"):
        build_cache(path, tokenizer_dir, keep_identical_pairs=True)
    pairs = write_records(str(tmp_path / "p.jsonl"), [{"prompt": "p", "chosen": " x",
                                                      "rejected": " x"}] * 2, "jsonl")  # fmt: skip
    out = str(tmp_path / "cli")
    args = ["build", "-i", pairs, "-t", tokenizer_dir, "-o", out, "--workers", "1"]
    result = CliRunner().invoke(main, [*args, "--preference", "--keep-identical-pairs"])
    assert result.exit_code == 0, result.output
    assert open_cache(out).num_sequences == 4
