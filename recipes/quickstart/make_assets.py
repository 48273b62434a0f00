"""Make the bundled quickstart assets: a small corpus and a small tokenizer trained on it.

The corpus is the docstrings of Python standard-library modules, classes and functions
(Python Software Foundation License), split into three input files of two formats. The
tokenizer is a byte-level BPE (vocab 4096) trained on that corpus with `tokenizers`, saved as
a transformers fast-tokenizer folder. The chat corpus (chat/) turns the same docstrings into
question/answer conversations for `recipes/sft-chat.toml`, and the preference corpus
(preference/) turns those answers into chosen/rejected pairs for `recipes/dpo.toml`. Run from
anywhere; it rewrites corpus/, tokenizer/, chat/ and preference/ beside this file
(``--chat-only``: only chat/ and preference/; ``--preference-only``: only preference/, from
the committed chat/):

    python recipes/quickstart/make_assets.py
"""

from __future__ import annotations

import importlib
import inspect
import itertools
import json
import os
import pkgutil
import sys
import warnings

import pyarrow as pa
import pyarrow.parquet as pq
import zstandard
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

HERE = os.path.dirname(os.path.abspath(__file__))
MODULES = sorted(
    m.name
    for m in pkgutil.iter_modules()
    if m.module_finder.path.startswith(sys.base_prefix)
    and not m.name.startswith("_")
    and "site-packages" not in m.module_finder.path
)
SKIP = {"antigravity", "this", "idlelib", "turtledemo", "tkinter", "turtle", "lib2to3", "test"}


def docstrings(limit: int = 900) -> list[dict[str, str]]:
    docs: list[dict[str, str]] = []
    seen: set[str] = set()
    for name in MODULES:
        if name in SKIP:
            continue
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                module = importlib.import_module(name)
        except Exception:
            continue
        members = [(name, module)]
        members += sorted(
            (f"{name}.{attr}", obj)
            for attr, obj in vars(module).items()
            if not attr.startswith("_")
            and (inspect.isclass(obj) or inspect.isfunction(obj))
            and getattr(obj, "__module__", None) == name
        )
        for qualname, obj in members:
            doc = inspect.getdoc(obj)
            if doc and len(doc) >= 120 and doc not in seen:
                seen.add(doc)
                docs.append({"id": qualname, "text": doc})
            if len(docs) >= limit:
                return docs
    return docs


def write_corpus(docs: list[dict[str, str]]) -> None:
    out = os.path.join(HERE, "corpus")
    os.makedirs(out, exist_ok=True)
    third = len(docs) // 3
    parts = [docs[:third], docs[third : 2 * third], docs[2 * third :]]
    for i, part in enumerate(parts[:2]):
        data = "".join(json.dumps(d, ensure_ascii=False) + "\n" for d in part).encode()
        with open(os.path.join(out, f"docs-{i:03d}.jsonl.zst"), "wb") as f:
            f.write(zstandard.ZstdCompressor(level=19).compress(data))
    pq.write_table(
        pa.Table.from_pylist(parts[2]), os.path.join(out, "docs-002.parquet"), compression="zstd"
    )


def train_tokenizer(docs: list[dict[str, str]]) -> None:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=4096,
        special_tokens=["<|endoftext|>", "<|pad|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator((d["text"] for d in docs), trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|endoftext|>",
        pad_token="<|pad|>",
        model_max_length=4096,
    )
    fast.save_pretrained(os.path.join(HERE, "tokenizer"))


def write_chat_corpus(docs: list[dict[str, str]]) -> None:
    """Conversations: an optional system prompt, one or two questions about an object, each
    answered with (a paragraph of) its docstring."""
    out = os.path.join(HERE, "chat")
    os.makedirs(out, exist_ok=True)
    lines = []
    for i in range(0, len(docs) - 1, 2):
        messages = []
        if i % 3 == 0:
            messages.append({"role": "system", "content": "You answer questions about Python."})
        for doc in docs[i : i + 1 + (i % 4 == 0)]:
            paragraphs = doc["text"].split("\n\n")
            messages.append({"role": "user", "content": f"What does `{doc['id']}` do?"})
            messages.append({"role": "assistant", "content": paragraphs[0]})
        lines.append(json.dumps({"id": f"chat-{i}", "messages": messages}, ensure_ascii=False))
    data = ("\n".join(lines) + "\n").encode()
    with open(os.path.join(out, "conversations.jsonl.zst"), "wb") as f:
        f.write(zstandard.ZstdCompressor(level=19).compress(data))


def write_preference_corpus() -> None:
    """String pairs from the chat corpus: per question, the answer's first sentence is chosen
    and the first sentence of the answer about another object (seven questions on) rejected."""
    with open(os.path.join(HERE, "chat", "conversations.jsonl.zst"), "rb") as f:
        data = zstandard.ZstdDecompressor().stream_reader(f).read().decode()
    turns = []
    for line in data.splitlines():
        messages = json.loads(line)["messages"]
        for question, answer in itertools.pairwise(messages):
            if question["role"] == "user" and answer["role"] == "assistant":
                first = answer["content"].split("\n\n")[0].replace("\n", " ")
                turns.append((question["content"], first.split(". ")[0].rstrip(".")[:200] + "."))
    lines = []
    for i, (question, answer) in enumerate(turns):
        other = turns[(i + 7) % len(turns)][1]
        if other == answer:
            continue
        record = {"prompt": f"Q: {question}\nA:", "chosen": f" {answer}", "rejected": f" {other}"}
        lines.append(json.dumps({"id": f"pair-{i}", **record}, ensure_ascii=False))
    out = os.path.join(HERE, "preference")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "pairs.jsonl.zst"), "wb") as f:
        f.write(zstandard.ZstdCompressor(level=19).compress(("\n".join(lines) + "\n").encode()))


def main() -> None:
    if "--preference-only" in sys.argv:
        write_preference_corpus()
        return
    docs = docstrings()
    write_chat_corpus(docs)
    write_preference_corpus()
    if "--chat-only" in sys.argv:
        return
    write_corpus(docs)
    train_tokenizer(docs)
    print(f"{len(docs)} documents, {sum(len(d['text']) for d in docs):,} characters")


if __name__ == "__main__":
    main()
