"""Shared fixtures: tokenizers trained in-process and corpus writers. Hermetic: no network,
nothing outside the repository and tmp folders."""

from __future__ import annotations

import gzip
import importlib.util
import json
import os
import random
import socket
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

WORDS = (
    "the quick brown fox jumps over lazy dog data shard cache token batch epoch rank worker "
    "parquet arrow stream budget bucket length python numpy torch tensor café naïve 東京 "
    "データ 🙂 def return class import lambda yield async await"
).split()


def make_texts(n: int, seed: int = 0, max_words: int = 120) -> list[str]:
    rng = random.Random(seed)
    texts = []
    for _ in range(n):
        k = rng.choice([1, 2, 5, 20, 60, max_words])
        texts.append(" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, k))))
    return texts


def write_word_corpus(folder: str, seed: int, files: int = 4, docs: int = 300) -> str:
    """``files`` jsonl files of ``docs`` random-word documents of 1-59 words (each unique)."""
    rng = np.random.default_rng(seed)
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota"]
    for f in range(files):
        with open(os.path.join(folder, f"part-{f}.jsonl"), "w") as out:
            for d in range(docs):
                n = int(rng.integers(1, 60))
                text = " ".join(rng.choice(words, n)) + f" doc{f}-{d}"
                out.write(json.dumps({"text": text}) + "\n")
    return str(folder)


def assert_same_ids_as_hf(tok: Any, backend: Any, texts: list[str]) -> None:
    """``backend.encode_flat(texts)`` (flat ids, no special tokens) equals the ``tokenizers``
    tokenizer ``tok``'s ``encode_batch`` of each text."""
    import numpy as np

    tokens, lengths = backend.encode_flat(texts)
    assert len(lengths) == len(texts)
    got = np.split(tokens, np.cumsum(lengths)[:-1]) if len(texts) else []
    want = [e.ids for e in tok.encode_batch(texts, add_special_tokens=False)]
    for text, mine, ids in zip(texts, got, want):
        assert mine.tolist() == ids, text[:80]


def run_in_threads(target: Callable[[], None], count: int = 2) -> None:
    """Run ``target`` in ``count`` threads at once and wait for all of them."""
    import threading

    threads = [threading.Thread(target=target) for _ in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def write_records(path: str, records: list[dict], fmt: str) -> str:
    """Write records as jsonl / jsonl.zst / json.gz / parquet; returns the path."""
    if fmt == "parquet":
        pq.write_table(pa.Table.from_pylist(records), path)
        return path
    data = b"".join(json.dumps(r, ensure_ascii=False).encode() + b"\n" for r in records)
    if fmt == "jsonl.zst":
        data = zstandard.ZstdCompressor().compress(data)
    elif fmt == "json.gz":
        data = gzip.compress(data, mtime=0)
    with open(path, "wb") as f:
        f.write(data)
    return path


def _save_bpe(
    folder: str,
    texts: list[str],
    vocab_size: int,
    bos: bool,
    extra_specials: tuple[str, ...] = (),
    chat_template: str | None = None,
) -> str:
    """Train a byte-level BPE tokenizer (<eos>, <pad>, <bos> + ``extra_specials``) and save it
    as a transformers folder; ``bos``: its post-processor prepends <bos>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<eos>", "<pad>", "<bos>", *extra_specials],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    if bos:
        tok.post_processor = processors.TemplateProcessing(
            single="<bos> $A", special_tokens=[("<bos>", tok.token_to_id("<bos>"))]
        )
    extra = {"additional_special_tokens": list(extra_specials)} if extra_specials else {}
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>", bos_token="<bos>", **extra
    )
    if chat_template is not None:
        fast.chat_template = chat_template
    fast.save_pretrained(folder)
    return folder


@pytest.fixture(autouse=True)
def _private_cache_dir(tmp_path_factory: pytest.TempPathFactory, monkeypatch) -> None:
    """Each test's downloads and integrity records (``$SHARDCACHE_CACHE_DIR``) go to a folder
    of its own: hermetic, and a test never skips a hash because another test recorded it."""
    monkeypatch.setenv("SHARDCACHE_CACHE_DIR", str(tmp_path_factory.mktemp("user-cache")))


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A byte-level BPE tokenizer (vocab 600) with <eos>, <pad>, <bos>; adds no specials."""
    folder = str(tmp_path_factory.mktemp("tok-bpe"))
    return _save_bpe(folder, make_texts(400, seed=1), 600, bos=False)


@pytest.fixture(scope="session")
def bos_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Like ``tokenizer_dir`` but its post-processor prepends <bos>."""
    folder = str(tmp_path_factory.mktemp("tok-bos"))
    return _save_bpe(folder, make_texts(400, seed=1), 600, bos=True)


@pytest.fixture(scope="session")
def wordpiece_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A BERT-style WordPiece tokenizer ([CLS] ... [SEP], no EOS token) whose saved
    tokenizer.json carries truncation (max_length 16) and padding settings."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    trainer = trainers.WordPieceTrainer(
        vocab_size=400,
        special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"],
        show_progress=False,
    )
    tok.train_from_iterator(make_texts(300, seed=2), trainer)
    tok.post_processor = processors.BertProcessing(
        ("[SEP]", tok.token_to_id("[SEP]")), ("[CLS]", tok.token_to_id("[CLS]"))
    )
    folder = str(tmp_path_factory.mktemp("tok-wordpiece"))
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="[UNK]",
        pad_token="[PAD]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        mask_token="[MASK]",
    )
    fast.save_pretrained(folder)
    path = os.path.join(folder, "tokenizer.json")
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    data["truncation"] = {
        "direction": "Right",
        "max_length": 16,
        "strategy": "LongestFirst",
        "stride": 0,
    }
    data["padding"] = {
        "strategy": {"Fixed": 16},
        "direction": "Right",
        "pad_to_multiple_of": None,
        "pad_id": 0,
        "pad_type_id": 0,
        "pad_token": "[PAD]",
    }
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f)
    return folder


@pytest.fixture(scope="session")
def big_vocab_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A WordLevel tokenizer whose *added* tokens push the largest id past 65535."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(65530)}
    vocab["[UNK]"] = len(vocab)
    vocab["<eos>"] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", eos_token="<eos>")
    fast.add_tokens([f"<extra_{i}>" for i in range(10)])
    folder = str(tmp_path_factory.mktemp("tok-big"))
    fast.save_pretrained(folder)
    return folder


@pytest.fixture()
def corpus(tmp_path) -> Callable[..., tuple[str, dict[tuple[str, int], str]]]:
    """``corpus(fmt, n_files, docs_per_file)`` writes a corpus; returns (folder, texts by
    (relpath, record index))."""

    def make(fmt: str = "jsonl", n_files: int = 2, docs: int = 40, seed: int = 0):
        folder = tmp_path / f"corpus-{fmt.replace('.', '-')}-{seed}"
        folder.mkdir()
        expected: dict[tuple[str, int], str] = {}
        for f in range(n_files):
            texts = make_texts(docs, seed=seed * 100 + f)
            name = f"part-{f:02d}.{fmt}"
            write_records(
                str(folder / name), [{"id": i, "text": t} for i, t in enumerate(texts)], fmt
            )
            expected.update({(name, i): t for i, t in enumerate(texts)})
        return str(folder), expected

    return make


@pytest.fixture()
def build_cache(tmp_path) -> Callable[..., str]:
    """``build_cache(input, tokenizer, **options)`` builds into a fresh folder; returns it.

    Builds in-process (``workers=1``) unless a test asks for workers: a process pool costs
    ~0.8 s to start, and the parallel path has its own tests in test_build.py."""
    from shardcache.builder.run import build_cache as build
    from shardcache.config import build_options_from_mapping

    counter = iter(range(1_000_000))

    def run(inputs: str | list[str], tokenizer: str, **options) -> str:
        out = str(tmp_path / f"cache-{next(counter)}")
        values = {"input": inputs, "tokenizer": tokenizer, "output": out, "workers": 1, **options}
        build(build_options_from_mapping(values))
        return out

    return run


CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Llama-2 style: the template writes BOS itself, before every user turn.
INST_TEMPLATE = (
    "{% if messages[0]['role'] == 'system' %}{% set sys = messages[0]['content'] %}"
    "{% set msgs = messages[1:] %}{% else %}{% set sys = '' %}{% set msgs = messages %}"
    "{% endif %}{% for m in msgs %}{% if m['role'] == 'user' %}{{ bos_token }}[INST] "
    "{% if loop.first and sys %}<<SYS>>{{ sys }}<</SYS>> {% endif %}{{ m['content'] }} [/INST]"
    "{% else %} {{ m['content'] }} {{ eos_token }}{% endif %}{% endfor %}"
)


def _chat_tokenizer(folder: str, template: str, bos_post_processor: bool) -> str:
    texts = [*make_texts(400, seed=5), "[INST] <<SYS>> user assistant system"]
    return _save_bpe(folder, texts, 700, bos_post_processor, ("<|im_start|>", "<|im_end|>"),
                     template)  # fmt: skip


@pytest.fixture(scope="session")
def chatml_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """BPE tokenizer with a ChatML chat template; adds no special tokens itself."""
    return _chat_tokenizer(str(tmp_path_factory.mktemp("tok-chatml")), CHATML_TEMPLATE, False)


@pytest.fixture(scope="session")
def inst_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """BPE tokenizer whose post-processor adds <bos> and whose template also writes it."""
    return _chat_tokenizer(str(tmp_path_factory.mktemp("tok-inst")), INST_TEMPLATE, True)


def make_conversations(n: int, seed: int = 0) -> list[list[dict[str, str]]]:
    rng = random.Random(seed)
    convs = []
    for _ in range(n):
        messages = []
        if rng.random() < 0.5:
            messages.append({"role": "system", "content": " ".join(rng.sample(WORDS, 4))})
        for _ in range(rng.randint(1, 3)):
            messages.append({"role": "user", "content": " ".join(rng.sample(WORDS, 5))})
            k = rng.randint(1, 12)
            messages.append({"role": "assistant", "content": " ".join(rng.choices(WORDS, k=k))})
        convs.append(messages)
    return convs


def assert_resumable(
    make: Callable[[], Any],
    stream: Callable[[Any], Iterable[Any]],
    key: Callable[[Any], Any] = lambda item: item,
    steps: Iterable[int] | None = None,
) -> list[Any]:
    """The generic resume check of every stateful stage.

    ``make()`` builds a fresh stage with ``state_dict()`` / ``load_state_dict()``; ``stream(stage)``
    iterates it. For every ``k`` in ``steps`` (default: every step, end included) it takes ``k``
    items from a fresh stage, saves its state through a JSON round trip, loads it into another
    fresh stage and asserts that the rest of the stream equals the uninterrupted one from ``k``.
    Returns the uninterrupted stream (as ``key`` values).
    """
    full = [key(item) for item in stream(make())]
    for k in range(len(full) + 1) if steps is None else steps:
        stage = make()
        iterator = iter(stream(stage))
        head = [key(next(iterator)) for _ in range(k)]
        assert head == full[:k]
        state = json.loads(json.dumps(stage.state_dict()))
        del iterator
        resumed = make()
        resumed.load_state_dict(state)
        rest = [key(item) for item in stream(resumed)]
        assert rest == full[k:], f"resume after {k} of {len(full)} items differs"
    return full


def eval_pass(
    make: Callable[[int], Any], world: int, workers: int, key: Callable[[Any], Iterable[Any]]
) -> list[Any]:
    """An evaluation pass over ``world`` ranks, ``make(rank)`` each, through a DataLoader.

    Asserts what every evaluation pass holds: each rank yields ``len(ds)`` batches, the same
    count on every rank, and a filler batch has no label. Returns ``key(batch)`` of every real
    batch, concatenated.
    """
    from torch.utils.data import DataLoader

    per_rank, real = [], []
    for rank in range(world):
        ds = make(rank)
        batches = list(DataLoader(ds, batch_size=None, num_workers=workers))
        assert len(batches) == len(ds)
        per_rank.append(len(batches))
        for b in batches:
            if bool(b["meta"]["filler"]):
                assert (b["labels"] == -100).all()
            else:
                real += key(b)
    assert len(set(per_rank)) == 1
    return real


def folder_files(folder: str) -> dict[str, bytes]:
    """Every file under ``folder``: relative path -> bytes."""
    out = {}
    for root, _, files in os.walk(folder):
        for name in files:
            path = os.path.join(root, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, folder)] = f.read()
    return out


def cache_data_files(folder: str) -> dict[str, bytes]:
    """A cache's shards and length index by relative path: the bytes that must not depend on
    how it was built (backend, memo, workers)."""
    out = {}
    for sub in ("shards", "index"):
        for name in sorted(os.listdir(os.path.join(folder, sub))):
            with open(os.path.join(folder, sub, name), "rb") as f:
                out[f"{sub}/{name}"] = f.read()
    return out


def assert_batches_equal(a: dict, b: dict) -> None:
    """Two batches hold the same keys in the same order and equal values (``meta`` too)."""
    import torch

    assert list(a) == list(b)
    for k in b:
        if isinstance(b[k], dict):
            assert_batches_equal(a[k], b[k])
        elif torch.is_tensor(b[k]):
            assert torch.equal(a[k], b[k]), k
        else:
            assert a[k] == b[k], k


#: A folder whose ``sitecustomize`` installs the kill hook of the crash tests in a process.
FAULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "faults")


def kill_env(spec: str, once: str | None = None) -> dict[str, str]:
    """Environment variables that make a build process started with them (and its pool and
    Ray workers) kill itself at the fault point ``spec`` (tests/faults/sitecustomize.py)."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    paths = [FAULTS_DIR, repo, *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {"SHARDCACHE_TEST_KILL": spec, "PYTHONPATH": os.pathsep.join(paths)}
    if once is not None:
        env["SHARDCACHE_TEST_KILL_ONCE"] = once
    return env


@pytest.fixture(scope="session")
def large_bpe_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A byte-level BPE tokenizer of a real-size vocabulary (40,000 entries, 39,700 merges,
    a 3 MB tokenizer.json), assembled rather than trained: for bugs that only show with a
    large tokenizer (a spawn payload larger than a pipe buffer)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {s: i for i, s in enumerate(["<eos>", "<pad>", "<bos>"])}
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[ch] = len(vocab)
    rng = random.Random(7)
    tokens = list("abcdefghijklmnopqrstuvwxyz")
    merges = []
    while len(vocab) < 40_000:
        a = rng.choice(tokens)
        b = rng.choice(tokens[:200] if rng.random() < 0.7 else tokens)
        if a + b not in vocab and len(a + b) <= 12:
            vocab[a + b] = len(vocab)
            merges.append((a, b))
            tokens.append(a + b)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>", bos_token="<bos>"
    )
    folder = str(tmp_path_factory.mktemp("tok-large-bpe"))
    fast.save_pretrained(folder)
    return folder


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture()
def s3(monkeypatch, tmp_path):
    """A moto S3 server on loopback with bucket ``corpus`` (slow tier); yields a boto3 client."""
    pytest.importorskip("s3fs")
    boto3 = pytest.importorskip("boto3")
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    for key, value in {
        "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": endpoint,
        "SHARDCACHE_CACHE_DIR": str(tmp_path / "local-cache"),
    }.items():  # fmt: skip
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    client = boto3.client("s3", endpoint_url=endpoint)
    client.create_bucket(Bucket="corpus")
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()
    try:
        yield client
    finally:
        s3fs.S3FileSystem.clear_instance_cache()
        server.stop()


def make_string_pairs(n: int, seed: int = 0, longest: int = 14) -> list[dict[str, str]]:
    """``n`` preference records of strings: completions of 1 to ``longest`` words."""
    rng = random.Random(seed)
    return [
        {
            "prompt": " ".join(rng.sample(WORDS, rng.randint(2, 8))),
            "chosen": " " + " ".join(rng.choices(WORDS, k=rng.randint(1, longest))),
            "rejected": " " + " ".join(rng.choices(WORDS, k=rng.randint(1, longest))),
        }
        for _ in range(n)
    ]


def make_chat_pairs(n: int, seed: int = 0) -> list[dict[str, list]]:
    """``n`` preference records of message lists: a conversation's last turn chosen."""
    rng = random.Random(seed)
    return [
        {
            "prompt": conv[:-1],
            "chosen": [conv[-1]],
            "rejected": [{"role": "assistant", "content": " ".join(rng.sample(WORDS, 3))}],
        }
        for conv in make_conversations(n, seed=seed)
    ]


def load_recipe(name: str) -> Any:
    """Import ``recipes/<name>.py`` (recipes are scripts, not a package)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    spec = importlib.util.spec_from_file_location(name, os.path.join(root, "recipes", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def pairs_cache(tmp_path_factory, tokenizer_dir) -> str:
    """A preference cache of 600 pairs in two buckets and a few dozen small shards."""
    from shardcache.builder.run import build_cache
    from shardcache.config import build_options_from_mapping

    folder = tmp_path_factory.mktemp("prefs")
    path = write_records(str(folder / "pairs.jsonl"), make_string_pairs(600, seed=4), "jsonl")
    out = str(folder / "cache")
    values = {
        "input": path, "tokenizer": tokenizer_dir, "output": out, "workers": 1,
        "kind": "preference", "buckets": "16,32", "shard_size": 4096,
    }  # fmt: skip
    build_cache(build_options_from_mapping(values))
    return out


def make_model(arch: str, impl: str, vocab_size: int) -> Any:
    """A tiny randomly initialised causal LM (2 layers, float32, no download): arch qwen2|llama."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    options = {
        "vocab_size": vocab_size,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 256,
        # larger than the 0.02 default: attention far from uniform, leakage clearly visible
        "initializer_range": 0.2,
    }
    config, cls = (
        (Qwen2Config(**options), Qwen2ForCausalLM)
        if arch == "qwen2"
        else (LlamaConfig(**options), LlamaForCausalLM)
    )
    model = cls._from_config(config, attn_implementation=impl, dtype=torch.float32)
    model.train()  # dropout is 0 in these configs; train() is what a training loop runs
    assert model.config.use_cache  # the default under which position_ids alone leak
    return model
