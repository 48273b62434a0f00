"""Losses computed a chunk of positions at a time equal those of the whole logits (values and
gradients), never hold more than a chunk's logits, and refuse models they would get wrong."""

from __future__ import annotations

import copy

import pytest
import torch

import shardcache
from conftest import make_model
from shardcache import ConfigError, ShardDataset
from shardcache.integrations.hf import causal_lm_loss, causal_lm_pair_logps, causal_lm_target_logps
from shardcache.read.losses import chunk_tokens_for, target_logps


def grads(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def hand_batch(vocab: int, weights: bool = False, length: int = 40) -> dict:
    """Three padded rows with prompts, padding and (optionally) per-token loss weights."""
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (3, length), generator=gen)
    labels = ids.clone()
    labels[0, :6] = -100  # a prompt
    labels[2, 29:] = -100  # padding
    mask = torch.ones_like(ids)
    mask[2, 29:] = 0
    batch = {"input_ids": ids, "labels": labels, "attention_mask": mask}
    if weights:
        w = torch.rand(ids.shape, generator=gen).clamp(min=0.1)
        batch["loss_weights"] = torch.where(labels != -100, w, 0.0)
    return batch


@pytest.mark.parametrize("chunk", [1, 7, 64, None])
def test_target_logps_equal_the_whole_log_softmax_with_gradients(chunk):
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(3, 11, 8, generator=gen, requires_grad=True)
    head = torch.nn.Linear(8, 50)  # with a bias: any output layer
    labels = torch.randint(0, 50, (3, 11), generator=gen)
    labels[1, 3:7] = -100
    labels[:, 0] = -100  # never a target (nothing scores position 0)
    upstream = torch.randn(3, 10, generator=gen)  # a loss that weighs every target differently

    got = target_logps(hidden, head, labels, chunk)
    (got * upstream).sum().backward()
    got_grads = (hidden.grad.clone(), head.weight.grad.clone(), head.bias.grad.clone())
    hidden.grad, head.weight.grad, head.bias.grad = None, None, None

    logps = head(hidden[:, :-1]).float().log_softmax(-1)
    targets = labels[:, 1:]
    want = logps.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    want = torch.where(targets != -100, want, 0.0)
    (want * upstream).sum().backward()
    assert got.shape == (3, 10) and got.dtype == torch.float32
    assert torch.allclose(got, want, atol=1e-6)
    assert (got[targets == -100] == 0).all()
    for mine, theirs in zip(got_grads, (hidden.grad, head.weight.grad, head.bias.grad)):
        assert torch.allclose(mine, theirs, atol=1e-6)


def test_target_logps_refuses_what_does_not_line_up():
    head = torch.nn.Linear(8, 50)
    with pytest.raises(ConfigError, match=r"hidden states of shape \(3, 11, 8\) for labels of "):
        target_logps(torch.zeros(3, 11, 8), head, torch.zeros(3, 12, dtype=torch.long))
    with pytest.raises(ConfigError, match="chunk_tokens is 0; use 1 or more"):
        target_logps(torch.zeros(3, 11, 8), head, torch.zeros(3, 11, dtype=torch.long), 0)
    assert chunk_tokens_for(151_936) == 220 and chunk_tokens_for(4096) == 8192


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
@pytest.mark.parametrize("weighted", [False, True])
def test_causal_lm_loss_equals_the_models_own_with_gradients(arch, weighted):
    """Chunks of 7 positions: the loss (the model's own mean, or weighted_loss of its logits)
    and every parameter's gradient equal those of the whole logits."""
    model = make_model(arch, "sdpa", 300)
    reference = copy.deepcopy(model)
    batch = hand_batch(300, weighted)

    chunked = causal_lm_loss(model, batch, chunk_tokens=7)
    chunked.backward()
    inputs = shardcache.model_inputs(batch)
    if weighted:
        inputs.pop("labels")
        whole = shardcache.weighted_loss(reference(**inputs).logits, batch)
    else:
        whole = reference(**inputs).loss
    whole.backward()
    assert chunked.item() == pytest.approx(whole.item(), rel=1e-6)
    assert torch.allclose(grads(model), grads(reference), rtol=1e-4, atol=1e-6)
    # chunk_tokens=0: the whole logits, the same figure
    assert causal_lm_loss(model, batch, chunk_tokens=0).item() == pytest.approx(whole.item())


@pytest.mark.parametrize("mode", ["pad", "pack-mask", "pack-varlen"])
def test_causal_lm_pair_logps_equal_pair_logps_of_the_logits(pairs_cache, tokenizer_dir, mode):
    vocab = int(shardcache.open_cache(pairs_cache).manifest["tokenizer"]["vocab_size"])
    model = make_model("qwen2", "sdpa", vocab).eval()
    options = {} if mode == "pad" else {"mode": "pack", "seq_len": 128,
                                         "attention": mode.split("-")[1]}  # fmt: skip
    batches = iter(ShardDataset(pairs_cache, 512, seed=0, **options))
    for _ in range(3):
        batch = next(batches)
        with torch.no_grad():
            inputs = {k: v for k, v in shardcache.model_inputs(batch).items() if k != "labels"}
            want = shardcache.pair_logps(model(**inputs, use_cache=False).logits, batch)
            got = causal_lm_pair_logps(model, batch, chunk_tokens=16)
        for mine, theirs in zip(got, want):
            assert len(mine) == len(theirs) > 0
            assert torch.allclose(mine, theirs, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize(("vocab", "chunk"), [(300, 16), (151_936, None)])
def test_no_call_of_the_output_layer_holds_more_than_a_chunk(vocab, chunk):
    """Forward and backward (the checkpointed chunks are recomputed there): the output layer
    sees at most a chunk of positions (by default 220 of a 151,936-entry vocabulary: 128 MiB of
    float32 logits), or the R rows of the one position the model scores itself, never the
    batch's R x L."""
    model = make_model("qwen2", "sdpa", vocab)
    batch = hand_batch(vocab, length=200)
    rows = []
    hook = model.get_output_embeddings().register_forward_hook(
        lambda module, args, out: rows.append(out.shape[:-1].numel())
    )
    try:
        causal_lm_loss(model, batch, chunk_tokens=chunk).backward()
    finally:
        hook.remove()
    targets = int((batch["labels"][:, 1:] != -100).sum())
    assert max(rows) == (chunk or chunk_tokens_for(vocab)) < targets
    assert sum(rows) == 3 + 3 + 2 * targets  # the model's own, the check, forward + backward


def test_a_model_that_scales_its_logits_is_refused_with_the_fix():
    model = make_model("qwen2", "sdpa", 300)
    model.config.final_logit_softcapping = 30.0
    with pytest.raises(ConfigError, match=r"final_logit_softcapping = 30\.0.*chunk_tokens=0"):
        causal_lm_loss(model, hand_batch(300))
    assert causal_lm_loss(model, hand_batch(300), chunk_tokens=0) > 0  # the way out works


def test_logits_that_are_not_the_output_layers_are_refused():
    """A model that transforms its logits without a config field saying so: the check of the
    one position it scores itself finds it."""

    class Doubled(type(make_model("qwen2", "sdpa", 300))):
        def forward(self, input_ids=None, logits_to_keep=0, **kwargs):
            out = super().forward(input_ids, logits_to_keep=logits_to_keep, **kwargs)
            out.logits = out.logits * 2
            return out

    base = make_model("qwen2", "sdpa", 300)
    model = Doubled(base.config)
    model.load_state_dict(base.state_dict())
    with pytest.raises(ConfigError, match=r"not its output layer applied to its last hidden"):
        causal_lm_target_logps(model, hand_batch(300))


@pytest.mark.parametrize("bad", [-1, 1.5, True])
def test_invalid_chunk_tokens_are_refused(bad):
    with pytest.raises(ConfigError, match="chunk_tokens is"):
        causal_lm_loss(make_model("qwen2", "sdpa", 300), hand_batch(300), chunk_tokens=bad)
