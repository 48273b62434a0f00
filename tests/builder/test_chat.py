from __future__ import annotations

import numpy as np
import pytest
from transformers import AutoTokenizer

from conftest import CHATML_TEMPLATE, make_conversations
from shardcache import ConfigError
from shardcache.builder.chat import ChatEncoder, ChatOptions, token_mask, validate_messages
from shardcache.builder.tokenize import TextEncoder, TruncationStats
from shardcache.config import TokenizeOptions


def _encoder(tokenizer_dir, chat=None, **tokenize):
    text = TextEncoder(TokenizeOptions(tokenizer_dir, append_eos=False, **tokenize))
    return ChatEncoder(text, chat or ChatOptions())


def _runs(mask):
    """Contiguous runs of True as (start, end) index pairs."""
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(int), [0]])))
    return list(zip(edges[::2], edges[1::2]))


def _turn_texts(messages, template):
    if template == "chatml":
        return [m["content"] + "<|im_end|>\n" for m in messages if m["role"] == "assistant"]
    return [" " + m["content"] + " <eos>" for m in messages if m["role"] == "assistant"]


@pytest.mark.parametrize("template", ["chatml", "inst"])
def test_masks_are_exactly_the_assistant_turns(template, chatml_tokenizer_dir, inst_tokenizer_dir):
    folder = chatml_tokenizer_dir if template == "chatml" else inst_tokenizer_dir
    encoder = _encoder(folder)
    tok = AutoTokenizer.from_pretrained(folder)
    convs = make_conversations(40, seed=1)
    assert any(c[0]["role"] == "system" for c in convs)
    assert any(c[0]["role"] != "system" for c in convs)
    samples = encoder.encode_texts(convs)
    for messages, sample in zip(convs, samples):
        assert sample.error is None and sample.straddle == 0
        runs = _runs(sample.mask)
        decoded = [tok.decode(sample.ids[a:b].tolist()) for a, b in runs]
        assert decoded == _turn_texts(messages, template)
        # nothing of the prompt is trainable, and the whole text is the rendered template
        assert tok.decode(sample.ids.tolist()) == tok.apply_chat_template(messages, tokenize=False)
    assert encoder.lint.template_mismatch == 0 and encoder.lint.template_checked > 0
    assert encoder.lint.double_bos == 0 and encoder.lint.missing_end_of_turn == 0


def test_exactly_one_bos_with_bos_writing_template_and_bos_adding_tokenizer(inst_tokenizer_dir):
    encoder = _encoder(inst_tokenizer_dir)
    tok = AutoTokenizer.from_pretrained(inst_tokenizer_dir)
    assert tok("x")["input_ids"][0] == tok.bos_token_id  # the tokenizer adds BOS...
    convs = [[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]]
    [sample] = encoder.encode_texts(convs)
    # ...and the template writes it: still exactly one at the start
    assert sample.ids[0] == tok.bos_token_id and sample.ids[1] != tok.bos_token_id
    rendered = tok.apply_chat_template(convs[0], tokenize=False)
    naive = tok(rendered)["input_ids"]  # the classic double-BOS bug
    assert naive[:2] == [tok.bos_token_id, tok.bos_token_id]


def test_bos_prepended_once_when_template_does_not_write_it(tmp_path, inst_tokenizer_dir):
    template = tmp_path / "plain.jinja"
    template.write_text(CHATML_TEMPLATE)
    encoder = _encoder(inst_tokenizer_dir, ChatOptions(template_path=str(template)))
    tok = AutoTokenizer.from_pretrained(inst_tokenizer_dir)
    [sample] = encoder.encode_texts(make_conversations(1, seed=3))
    assert sample.ids[0] == tok.bos_token_id and sample.ids[1] != tok.bos_token_id
    assert not sample.mask[0]


def test_train_on_modes(chatml_tokenizer_dir):
    convs = [c for c in make_conversations(30, seed=4) if len(c) >= 4]
    last = _encoder(chatml_tokenizer_dir, ChatOptions(train_on="last-assistant"))
    every = _encoder(chatml_tokenizer_dir, ChatOptions(train_on="all"))
    default = _encoder(chatml_tokenizer_dir)
    tok = AutoTokenizer.from_pretrained(chatml_tokenizer_dir)
    for messages, s_last, s_all, s_def in zip(
        convs, last.encode_texts(convs), every.encode_texts(convs), default.encode_texts(convs)
    ):
        [(a, b)] = _runs(s_last.mask)
        assert tok.decode(s_last.ids[a:b].tolist()) == _turn_texts(messages, "chatml")[-1]
        assert s_all.mask.all()
        assert np.array_equal(s_last.ids, s_def.ids)
        assert s_last.mask.sum() < s_def.mask.sum() < s_all.mask.sum()


def test_truncation_sides_and_zero_trainable_dropped(chatml_tokenizer_dir):
    convs = [
        [
            {"role": "user", "content": " ".join(["data"] * 30)},
            {"role": "assistant", "content": "short answer"},
        ],
    ] * 3
    for side, kept in (("left", 3), ("right", 0)):
        encoder = _encoder(chatml_tokenizer_dir, ChatOptions(truncation_side=side), max_length=12)
        stats = TruncationStats()
        encoded = encoder.finish(encoder.encode_texts(convs), stats)
        assert len(encoded.lengths) == kept
        assert stats.truncated_documents == 3
        assert stats.dropped_no_trainable == 3 - kept
        assert all(n <= 12 for n in encoded.lengths)
        if kept:
            assert encoded.mask.sum() == stats.trainable_tokens > 0


def test_conversation_without_assistant_is_dropped_not_stored(chatml_tokenizer_dir):
    encoder = _encoder(chatml_tokenizer_dir)
    stats = TruncationStats()
    encoded = encoder.finish(encoder.encode_texts([[{"role": "user", "content": "hi"}]]), stats)
    assert len(encoded.lengths) == 0 and stats.dropped_no_trainable == 1


def test_non_incremental_template_is_reported(tmp_path, chatml_tokenizer_dir):
    template = tmp_path / "count.jinja"
    template.write_text("{{ messages|length }} " + CHATML_TEMPLATE)
    encoder = _encoder(chatml_tokenizer_dir, ChatOptions(template_path=str(template)))
    stats = TruncationStats()
    encoded = encoder.finish(encoder.encode_texts(make_conversations(2)), stats)
    assert [reason for _, reason, _ in encoded.failed] == ["template_not_incremental"] * 2


def test_validate_messages_reasons():
    assert validate_messages(None) == "no_messages_field"
    assert validate_messages("hi") == "messages_not_list"
    assert validate_messages([]) == "empty_messages"
    assert validate_messages([{"role": "user"}]) == "bad_message"
    assert validate_messages([{"role": "user", "content": "x"}]) is None


def test_token_mask_counts_boundary_tokens():
    offsets = np.array([[0, 3], [3, 6], [6, 9]])
    mask, straddle = token_mask(offsets, [(4, 9)])
    assert mask.tolist() == [False, False, True] and straddle == 1


def test_options_validated(tmp_path):
    with pytest.raises(ConfigError, match="train_on"):
        ChatOptions(train_on="user")
    with pytest.raises(ConfigError, match="truncation_side"):
        ChatOptions(truncation_side="middle")
    with pytest.raises(ConfigError, match="not a file"):
        ChatOptions(template_path=str(tmp_path / "none.jinja"))
