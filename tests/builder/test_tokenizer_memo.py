"""The memo of what transformers resolves from a tokenizer folder (builder/tokenizer_memo.py).

A warm memo gives byte-identical builds and keys without importing transformers; any change
to a tokenizer file misses it; a missing, damaged, forged or unreadable memo only means
loading through transformers again; ``SHARDCACHE_NO_MEMO=1`` bypasses it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
from click.testing import CliRunner
from test_backends import FAMILIES

from conftest import cache_data_files
from shardcache.builder import key_computation as keying
from shardcache.builder import tokenize
from shardcache.builder import tokenizer_memo as resolved
from shardcache.builder.encoders import make_encoder
from shardcache.builder.run import build_cache
from shardcache.builder.tokenize import TextEncoder
from shardcache.builder.tokenizer_memo import RESOLVED_DIR, folder_digest, read_resolved
from shardcache.cli import main
from shardcache.config import TokenizeOptions, build_options_from_mapping
from shardcache.store.files import NO_MEMO_ENV, cache_root

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _memo_files() -> list[str]:
    folder = os.path.join(cache_root(), RESOLVED_DIR)
    return sorted(os.listdir(folder)) if os.path.isdir(folder) else []


def _build(corpus: str, tokenizer: str, out: str) -> dict:
    values = {"input": corpus, "tokenizer": tokenizer, "output": out, "workers": 1,
              "batch_docs": 16}  # fmt: skip
    build_cache(build_options_from_mapping(values))
    with open(os.path.join(out, "manifest.json"), encoding="utf-8") as f:
        return json.load(f)


def _refuse_transformers(monkeypatch) -> None:
    def refuse(path):
        raise AssertionError(f"loaded {path!r} through transformers despite a warm memo")

    monkeypatch.setattr(tokenize, "load_hf_tokenizer", refuse)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory) -> str:
    return FAMILIES[request.param](str(tmp_path_factory.mktemp(f"tok-{request.param}")))


def test_warm_memo_build_is_byte_identical_to_cold_and_disabled(family, corpus, tmp_path,
                                                                monkeypatch):  # fmt: skip
    """For every tokenizer family: shards, index and key equal with the memo cold (written by
    this build), warm (transformers not loaded) and disabled."""
    hard_corpus, _ = corpus("jsonl.zst", n_files=2, docs=40)
    cold = _build(hard_corpus, family, str(tmp_path / "cold"))
    assert len(_memo_files()) == 1
    with monkeypatch.context() as m:
        _refuse_transformers(m)
        warm = _build(hard_corpus, family, str(tmp_path / "warm"))
    monkeypatch.setenv(NO_MEMO_ENV, "1")
    off = _build(hard_corpus, family, str(tmp_path / "off"))
    for name, manifest in (("warm", warm), ("off", off)):
        assert cache_data_files(str(tmp_path / name)) == cache_data_files(str(tmp_path / "cold")), (
            name
        )
        for field in ("key", "tokenizer", "encoder"):
            assert manifest[field] == cold[field], (name, field)


@pytest.mark.parametrize(
    "fixture", ["tokenizer_dir", "bos_tokenizer_dir", "wordpiece_dir", "big_vocab_dir",
                "chatml_tokenizer_dir"],
)  # fmt: skip
def test_the_key_from_the_memo_equals_the_key_through_transformers(fixture, request):
    """Saved truncation/padding (wordpiece), uint32 ids (big_vocab), additional specials
    (chatml): the key, the description and the spec are the same from either source."""
    folder = request.getfixturevalue(fixture)
    options = TokenizeOptions(folder, max_length=64)
    loaded = make_encoder(options, None)  # cold: through transformers, writes the memo
    assert loaded.hf is not None and len(_memo_files()) == 1
    memo = make_encoder(options, None)
    assert memo.hf is None and memo.resolved == loaded.resolved
    assert keying.compute_key(memo, None).to_json() == keying.compute_key(loaded, None).to_json()
    assert memo.describe() == loaded.describe()
    assert memo.spec() == loaded.spec()
    assert (memo.eos_id, memo.pad_id, memo.dtype) == (loaded.eos_id, loaded.pad_id, loaded.dtype)


def _run_python(code: str, env_extra: dict[str, str]) -> dict:
    env = {**os.environ, "PYTHONPATH": REPO, **env_extra}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True)  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])


BUILD_AND_REPORT = """
import json, sys
from shardcache.builder.run import build_cache
from shardcache.config import build_options_from_mapping
corpus, tokenizer, out = sys.argv[1:] if len(sys.argv) > 1 else {args!r}
build_cache(build_options_from_mapping({{"input": corpus, "tokenizer": tokenizer,
                                         "output": out, "workers": 1}}))
print(json.dumps({{"transformers": "transformers" in sys.modules,
                  "torch": "torch" in sys.modules}}))
"""


def test_a_warm_memo_build_does_not_import_transformers(corpus, tokenizer_dir, tmp_path):
    folder, _ = corpus("jsonl", n_files=1, docs=30)
    env = {"SHARDCACHE_CACHE_DIR": str(tmp_path / "user-cache")}
    cold = _run_python(BUILD_AND_REPORT.format(args=[folder, tokenizer_dir,
                                                     str(tmp_path / "a")]), env)  # fmt: skip
    assert cold == {"transformers": True, "torch": False}
    assert os.listdir(tmp_path / "user-cache" / RESOLVED_DIR)  # the cold build wrote the memo
    warm = _run_python(BUILD_AND_REPORT.format(args=[folder, tokenizer_dir,
                                                     str(tmp_path / "b")]), env)  # fmt: skip
    assert warm == {"transformers": False, "torch": False}
    assert cache_data_files(str(tmp_path / "a")) == cache_data_files(str(tmp_path / "b"))


def test_a_changed_tokenizer_file_misses_the_memo_and_gives_the_new_key(tokenizer_dir, tmp_path,
                                                                        monkeypatch):  # fmt: skip
    folder = str(tmp_path / "tok")
    shutil.copytree(tokenizer_dir, folder)
    options = TokenizeOptions(folder)
    before = keying.compute_key(make_encoder(options, None), None)
    assert make_encoder(options, None).hf is None  # warm
    path = os.path.join(folder, "tokenizer_config.json")
    with open(path, encoding="utf-8") as f:
        config = json.load(f)
    config["eos_token"] = "<bos>"
    with open(path, "w", encoding="utf-8") as f:
        json.dump(config, f)
    changed = make_encoder(options, None)
    assert changed.hf is not None  # missed: loaded through transformers
    after = keying.compute_key(changed, None)
    assert after.digest != before.digest
    end_id = after.components["special_tokens"]["end_id"]
    assert end_id == changed.hf.convert_tokens_to_ids("<bos>") == changed.eos_id
    monkeypatch.setenv(NO_MEMO_ENV, "1")
    assert keying.compute_key(make_encoder(options, None), None).to_json() == after.to_json()
    monkeypatch.delenv(NO_MEMO_ENV)
    warm = make_encoder(options, None)
    assert warm.hf is None and keying.compute_key(warm, None).to_json() == after.to_json()


def test_the_digest_covers_tokenizer_files_and_library_versions(tokenizer_dir, tmp_path,
                                                                monkeypatch):  # fmt: skip
    folder = str(tmp_path / "tok")
    shutil.copytree(tokenizer_dir, folder)
    digest = folder_digest(folder)
    (tmp_path / "tok" / "model.safetensors").write_bytes(b"weights are never read")
    assert folder_digest(folder) == digest  # model weights are not hashed
    os.mkdir(tmp_path / "tok" / "subfolder")
    assert folder_digest(folder) == digest  # only files directly in the folder
    (tmp_path / "tok" / "special_tokens_map.json").write_text("{}")
    assert folder_digest(folder) not in (digest, None)
    os.remove(tmp_path / "tok" / "special_tokens_map.json")
    assert folder_digest(folder) == digest
    real = resolved.library_versions
    for package in resolved.RESOLVER_PACKAGES:

        def upgraded(names, package=package):
            return {**real(names), package: "99.0"}

        monkeypatch.setattr(resolved, "library_versions", upgraded)
        assert folder_digest(folder) != digest, package
    monkeypatch.setattr(resolved, "library_versions", real)
    assert folder_digest(folder) == digest
    assert folder_digest(str(tmp_path / "missing")) is None


def _damage(path: str, how: str) -> None:
    with open(path, encoding="utf-8") as f:
        saved = json.load(f)
    if how == "unreadable":  # a folder where the file was: open() fails with an OSError
        os.remove(path)
        os.mkdir(path)
        return
    if how == "garbage":
        text = '{"input": "' + saved["input"][:10]
    elif how == "other-input":  # a memo copied from another folder's name
        text = json.dumps({**saved, "input": "0" * 64})
    elif how == "wrong-type":
        text = json.dumps({**saved, "value": {**saved["value"], "max_token_id": "many"}})
    elif how == "missing-field":
        value = {k: v for k, v in saved["value"].items() if k != "all_special"}
        text = json.dumps({**saved, "value": value})
    else:  # not-an-object
        text = json.dumps({**saved, "value": [1, 2]})
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


@pytest.mark.parametrize(
    "how", ["garbage", "other-input", "wrong-type", "missing-field", "not-an-object", "unreadable"]
)
def test_a_damaged_forged_or_unreadable_memo_falls_back_to_transformers(how, bos_tokenizer_dir):
    options = TokenizeOptions(bos_tokenizer_dir)
    want = keying.compute_key(make_encoder(options, None), None).to_json()
    (name,) = _memo_files()
    _damage(os.path.join(cache_root(), RESOLVED_DIR, name), how)
    assert read_resolved(bos_tokenizer_dir) is None
    again = make_encoder(options, None)
    assert again.hf is not None  # loaded through transformers
    assert keying.compute_key(again, None).to_json() == want
    if how != "unreadable":  # rewritten: the next one is warm again
        warm = make_encoder(options, None)
        assert warm.hf is None and keying.compute_key(warm, None).to_json() == want


def test_an_unusable_cache_folder_only_costs_transformers(tokenizer_dir, tmp_path, monkeypatch):
    want = keying.compute_key(make_encoder(TokenizeOptions(tokenizer_dir), None), None).to_json()
    blocked = tmp_path / "file-not-folder"
    blocked.write_text("x")
    monkeypatch.setenv("SHARDCACHE_CACHE_DIR", str(blocked))
    for _ in range(2):
        encoder = make_encoder(TokenizeOptions(tokenizer_dir), None)
        assert encoder.hf is not None
        assert keying.compute_key(encoder, None).to_json() == want


def test_no_memo_env_neither_reads_nor_writes(tokenizer_dir, monkeypatch):
    make_encoder(TokenizeOptions(tokenizer_dir), None)
    assert len(_memo_files()) == 1
    monkeypatch.setenv(NO_MEMO_ENV, "1")
    shutil.rmtree(cache_root())
    encoder = make_encoder(TokenizeOptions(tokenizer_dir), None)
    keying.compute_key(encoder, None)
    assert encoder.hf is not None
    assert os.listdir(cache_root()) == []  # neither the tokenizer nor the component memo
    monkeypatch.setenv(NO_MEMO_ENV, "0")  # 0 / empty: memos on
    make_encoder(TokenizeOptions(tokenizer_dir), None)
    assert len(_memo_files()) == 1


def test_a_chat_encoder_always_loads_transformers(chatml_tokenizer_dir):
    from shardcache.config import ChatOptions

    make_encoder(TokenizeOptions(chatml_tokenizer_dir), None)  # warms the memo
    chat = make_encoder(TokenizeOptions(chatml_tokenizer_dir), ChatOptions())
    assert chat.hf is not None and chat.text.hf is not None


def test_check_resolves_through_transformers_even_with_a_warm_memo(
    corpus, tokenizer_dir, tmp_path, monkeypatch
):
    folder, _ = corpus("jsonl", n_files=1, docs=20)
    out = str(tmp_path / "cache")
    build_cache(build_options_from_mapping({"input": folder, "tokenizer": tokenizer_dir,
                                            "output": out, "workers": 1}))  # fmt: skip
    runner = CliRunner()

    def check(*flags: str) -> tuple[int, str]:
        result = runner.invoke(main, ["check", out, "-t", tokenizer_dir, "-i", folder, *flags])
        return result.exit_code, result.stdout  # stderr: the hashing speed differs

    assert read_resolved(tokenizer_dir) is not None  # the build left the memo warm
    loads = []
    real = tokenize.load_hf_tokenizer
    monkeypatch.setattr(
        tokenize, "load_hf_tokenizer", lambda path: loads.append(path) or real(path)
    )
    warm = [check(), check("--max-length", "8"), check("--json")]
    assert loads == [tokenizer_dir] * 3  # an audit never reads the memo
    monkeypatch.setenv(NO_MEMO_ENV, "1")
    off = [check(), check("--max-length", "8"), check("--json")]
    assert warm == off
    assert [code for code, _ in warm] == [0, 1, 0]


def test_a_caller_tokenizer_is_not_memoised(tokenizer_dir):
    """A transformers object the caller passes may have been changed in memory (added
    tokens): its state is not the folder's, so nothing is remembered."""
    from shardcache.builder.tokenize import load_hf_tokenizer

    hf = load_hf_tokenizer(tokenizer_dir)
    hf.add_special_tokens({"additional_special_tokens": ["<extra>"]})
    TextEncoder(TokenizeOptions(tokenizer_dir), hf_tokenizer=hf)
    assert _memo_files() == []


# --- a poisoned memo (someone edited $SHARDCACHE_CACHE_DIR/tokenizers/<digest>.json) --------


def _poison_memo(tokenizer: str) -> None:
    """Swap the ids of the two vocabulary entries the corpus uses most in the folder's memo,
    keeping the memo's own digest and shape valid (what an attacker or a bad copy can do)."""
    from tokenizers import Tokenizer

    (name,) = _memo_files()
    path = os.path.join(cache_root(), RESOLVED_DIR, name)
    with open(path, encoding="utf-8") as f:
        saved = json.load(f)
    backend = json.loads(saved["value"]["backend"])
    vocab = backend["model"]["vocab"]
    reference = Tokenizer.from_file(os.path.join(tokenizer, "tokenizer.json"))
    a, b = reference.encode(" the quick", add_special_tokens=False).tokens[:2]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    saved["value"]["backend"] = json.dumps(backend)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(saved, f)


def test_a_poisoned_memo_never_changes_the_ids_a_build_stores(corpus, tokenizer_dir, tmp_path):
    folder, _ = corpus("jsonl", n_files=1, docs=60)
    reference = _build(folder, tokenizer_dir, str(tmp_path / "reference"))  # writes the memo
    _poison_memo(tokenizer_dir)
    again = _build(folder, tokenizer_dir, str(tmp_path / "again"))
    assert cache_data_files(str(tmp_path / "again")) == cache_data_files(
        str(tmp_path / "reference")
    )
    assert again["key"] == reference["key"]


def test_audits_never_read_the_memo(corpus, tokenizer_dir, tmp_path):
    """A good cache stays good and compatible whatever the memo says: ``check``, ``lock`` and
    ``verify --tokens`` resolve the tokenizer from its files."""
    folder, _ = corpus("jsonl", n_files=1, docs=60)
    out = str(tmp_path / "cache")
    _build(folder, tokenizer_dir, out)
    _poison_memo(tokenizer_dir)
    runner = CliRunner()
    check = runner.invoke(main, ["check", out, "-t", tokenizer_dir, "-i", folder])
    assert check.exit_code == 0, check.output
    verify = runner.invoke(main, ["verify", out, "--tokens", "--fraction", "1"])
    assert verify.exit_code == 0, verify.output
    lock = str(tmp_path / "shardcache.lock")
    written = runner.invoke(main, ["lock", "-t", tokenizer_dir, "-i", folder, "-o", lock])
    assert written.exit_code == 0, written.output
    assert runner.invoke(main, ["check", out, "--lock", lock]).exit_code == 0


def test_the_memo_is_checked_against_the_tokenizer_json_text_given(tokenizer_dir):
    """``read_resolved(folder, saved)`` uses the record only when it agrees with ``saved``, the
    text the build's early fast load starts from (not another read of the file)."""
    make_encoder(TokenizeOptions(tokenizer_dir), None)  # writes the memo
    text = resolved.tokenizer_json_text(tokenizer_dir)
    assert text is not None and read_resolved(tokenizer_dir, text) is not None
    other = json.loads(text)
    vocab = other["model"]["vocab"]
    a, b = sorted(vocab)[:2]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    assert read_resolved(tokenizer_dir, json.dumps(other)) is None
    assert resolved.tokenizer_json_text(os.path.join(tokenizer_dir, "absent")) is None


def test_parse_tokenizer_json_pauses_the_collector_and_restores_it(tokenizer_dir, monkeypatch):
    """The parse equals json.loads, runs with the collector off, and leaves it as it was,
    on an error too."""
    import gc

    text = resolved.tokenizer_json_text(tokenizer_dir)
    seen = []
    real = json.loads
    monkeypatch.setattr(json, "loads", lambda value: seen.append(gc.isenabled()) or real(value))
    assert resolved.parse_tokenizer_json(text) == real(text) and seen == [False]
    monkeypatch.undo()
    assert gc.isenabled()
    with pytest.raises(ValueError):
        resolved.parse_tokenizer_json("{not json")
    assert gc.isenabled()
    gc.disable()
    try:
        resolved.parse_tokenizer_json("[]")
        assert not gc.isenabled()
    finally:
        gc.enable()
