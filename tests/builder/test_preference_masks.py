"""Loss masks of preference pairs against a held-out chat tokenizer (issue 47).

The tokenizer is built here, not shared with the other tests: a Qwen2-style byte-level BPE
(Qwen2's pre-tokenizer split, NFC, ``<|endoftext|>`` / ``<|im_start|>`` / ``<|im_end|>``)
with a Qwen2-style ChatML template that writes a default system turn when the conversation has
none. For every pair the trainable tokens must be the tokenizer's ids of the completion as TRL
cuts it: the full rendering minus the prompt rendered with the generation prompt.
"""

from __future__ import annotations

import random
import types

import pytest

from conftest import WORDS, make_texts, write_records
from shardcache import open_cache

#: Qwen2's pre-tokenizer pattern: letters with one leading non-letter, single digits,
#: punctuation runs, newlines, then spaces.
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

#: ChatML as Qwen2-family models write it: a default system turn unless the first message is
#: one, an assistant turn with tool calls and no content written without a content line.
QWEN2_STYLE_TEMPLATE = (
    "{%- if messages[0]['role'] != 'system' %}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' and message.tool_calls %}"
    "{{- '<|im_start|>assistant' }}"
    "{%- for call in message.tool_calls %}"
    "{{- '\\n<tool_call>\\n' + call.name + '</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


@pytest.fixture(scope="module")
def qwen2_style_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])  # fmt: skip
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=900, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    texts = [*make_texts(300, seed=41), "system user assistant helpful 12345 \n\n"]
    tok.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>",
                                   additional_special_tokens=specials[1:])  # fmt: skip
    fast.chat_template = QWEN2_STYLE_TEMPLATE
    folder = str(tmp_path_factory.mktemp("tok-qwen2-style"))
    fast.save_pretrained(folder)
    return folder


def _pairs(n: int, seed: int) -> list[dict]:
    """Explicit and implicit-prompt pairs: system turn or not, 1 to 3 prompt turns, digits,
    newlines and non-ASCII text in the contents."""
    rng = random.Random(seed)

    def text(k: int) -> str:
        words = rng.choices([*WORDS, "2024", "x=1;", "\n", "  "], k=rng.randint(1, k))
        return " ".join(words).strip() or "ok"

    records = []
    for i in range(n):
        prompt = [{"role": "system", "content": text(6)}] if rng.random() < 0.4 else []
        for _ in range(rng.randint(0, 2)):
            prompt += [{"role": "user", "content": text(8)},
                       {"role": "assistant", "content": text(8)}]  # fmt: skip
        prompt.append({"role": "user", "content": text(10)})
        chosen = [{"role": "assistant", "content": text(14)}]
        rejected = [{"role": "assistant", "content": text(14)}]
        if i % 2:
            records.append({"chosen": prompt + chosen, "rejected": prompt + rejected})
        else:
            records.append({"prompt": prompt, "chosen": chosen, "rejected": rejected})
    return records


@pytest.mark.parametrize("append_eos", [True, False])
def test_trainable_tokens_are_the_completion_ids_for_every_pair(append_eos, tmp_path, build_cache,
                                                                qwen2_style_dir):  # fmt: skip
    from transformers import AutoTokenizer

    records = _pairs(120, seed=42)
    path = write_records(str(tmp_path / "pairs.jsonl"), records, "jsonl")
    cache = open_cache(build_cache(path, qwen2_style_dir, kind="preference",
                                   append_eos=append_eos))  # fmt: skip
    hf = AutoTokenizer.from_pretrained(qwen2_style_dir)
    # message lists end as the template ends the turn: no EOS appended whatever append_eos
    # (which applies to string pairs), as for chat data and TRL's DPOTrainer
    eos: list[int] = []
    seqs = sorted(cache.iter_sequences(), key=lambda s: s.sample_id)
    assert len(seqs) == 2 * len(records)  # every pair kept: 100% of them checked below
    for seq in seqs:
        record = records[seq.provenance.record]
        side = ("chosen", "rejected")[seq.provenance.piece]
        if "prompt" in record:
            prompt, completion = record["prompt"], record[side]
        else:
            prompt, completion = record[side][:-1], record[side][-1:]
        prompt_text = hf.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
        full = hf.apply_chat_template(prompt + completion, tokenize=False)
        assert full.startswith(prompt_text)
        want = [*hf(full[len(prompt_text) :], add_special_tokens=False)["input_ids"], *eos]
        assert seq.ids[seq.mask].tolist() == want
        assert seq.ids.tolist() == [*hf(full, add_special_tokens=False)["input_ids"], *eos]
        first = int(seq.mask.argmax())
        assert seq.mask[first:].all()  # the completion is one trainable run at the end
        assert seq.ids[:first].tolist() == hf(prompt_text, add_special_tokens=False)["input_ids"]
    lint = cache.manifest["stats"]["lint"]
    assert lint["template_checked"] > 0 and lint["template_mismatch"] == 0
    assert lint["boundary_tokens"] == 0


def test_truncated_pairs_train_on_the_kept_completion_ids(tmp_path, build_cache, qwen2_style_dir):
    """``truncation = "truncate"``: the prompt keeps its last ``max_prompt_length`` ids, the
    completion its first ``max_length - prompt``; trainable = the completion ids kept."""
    from transformers import AutoTokenizer

    records = [r for r in _pairs(120, seed=43) if "prompt" in r]
    path = write_records(str(tmp_path / "pairs.jsonl"), records, "jsonl")
    limits = {"truncation": "truncate", "max_prompt_length": 24, "max_length": 40}
    cache = open_cache(build_cache(path, qwen2_style_dir, kind="preference", **limits))
    hf = AutoTokenizer.from_pretrained(qwen2_style_dir)
    seqs = list(cache.iter_sequences())
    assert len(seqs) == 2 * len(records)
    cut = 0
    for seq in seqs:
        record = records[seq.provenance.record]
        completion = record[("chosen", "rejected")[seq.provenance.piece]]
        prompt_text = hf.apply_chat_template(record["prompt"], tokenize=False,
                                             add_generation_prompt=True)  # fmt: skip
        full = hf.apply_chat_template(record["prompt"] + completion, tokenize=False)
        prompt = hf(prompt_text, add_special_tokens=False)["input_ids"][-24:]
        ids = hf(full[len(prompt_text) :], add_special_tokens=False)["input_ids"]
        kept = ids[: 40 - len(prompt)]
        assert seq.ids.tolist() == prompt + kept
        assert seq.ids[seq.mask].tolist() == kept
        cut += len(kept) < len(ids)
    assert cut > 10 and cache.manifest["stats"]["truncated_documents"] > 10


@pytest.mark.slow  # importing trl takes 6-15 s
@pytest.mark.filterwarnings("ignore::FutureWarning")  # TRL's config on transformers' arguments
def test_conversational_pairs_equal_trls_dpo_tokenization(tmp_path, build_cache, qwen2_style_dir):
    """TRL's own DPO preprocessing (``DPOTrainer._prepare_dataset``, then its collator with
    ``max_length`` and ``truncation_mode="keep_start"``) gives the ids and completion masks
    stored here with ``truncation = "truncate"``, ``max_length`` and no EOS appended (TRL
    appends none to conversations), and drops the same pairs (a prompt filling max_length)."""
    pytest.importorskip("trl")
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import DPOConfig
    from trl.trainer.dpo_trainer import DataCollatorForPreference, DPOTrainer

    if not hasattr(DPOTrainer, "_prepare_dataset"):
        pytest.skip("this TRL version tokenizes elsewhere")
    records = [{**r, "id": k} for k, r in enumerate(r for r in _pairs(80, seed=44)
                                                   if "prompt" in r)]  # fmt: skip
    hf = AutoTokenizer.from_pretrained(qwen2_style_dir)
    config = DPOConfig(output_dir=str(tmp_path / "trl"), max_length=64, report_to="none",
                       truncation_mode="keep_start", bf16=False, use_cpu=True)  # fmt: skip
    theirs = DPOTrainer._prepare_dataset(
        types.SimpleNamespace(_tokenizer=hf), Dataset.from_list(records), hf, config, "train"
    )
    collate = DataCollatorForPreference(pad_token_id=hf.pad_token_id, max_length=64,
                                        truncation_mode="keep_start")  # fmt: skip
    path = write_records(str(tmp_path / "pairs.jsonl"), records, "jsonl")
    cache = open_cache(build_cache(path, qwen2_style_dir, kind="preference", append_eos=False,
                                   truncation="truncate", max_length=64))  # fmt: skip
    ours = {(s.provenance.record, s.provenance.piece): s for s in cache.iter_sequences()}
    assert sorted({r for r, _ in ours}) == sorted(theirs["id"]) and 10 < len(theirs) < 40
    for row in theirs:
        batch = collate([{k: row[k] for k in ("prompt_ids", "chosen_ids", "rejected_ids")}])
        for side in (0, 1):  # rows: chosen, then rejected
            real = batch["attention_mask"][side].bool()
            seq = ours[(row["id"], side)]
            assert seq.ids.tolist() == batch["input_ids"][side][real].tolist()
            assert seq.mask.tolist() == batch["completion_mask"][side][real].bool().tolist()
    assert cache.manifest["stats"]["truncated_documents"] > 0
