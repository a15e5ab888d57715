"""The decoder's own steps against the model's forward with the library's cache.

Random Llama models (tied and untied output heads, grouped-query attention), left-padded
batches and single prompts: every step's logits agree with ``forward``'s, sampling draws
the same tokens with the same log-probabilities, and models the decoder must not step
itself (hooked, another architecture) go through ``forward``.
"""

from __future__ import annotations

import pytest
import torch

from crawl2chat.stages.inference.generation import SamplingParams, positions, sample_batch, stream_tokens
from crawl2chat.stages.inference.kv_decoder import KVDecoder, forward_with_cache, steps_in_place
from crawl2chat.stages.training.chat_data import pad
from crawl2chat.stages.training.models import build_model, model_config


def _model(kv_heads: int = 4, tied: bool = True, seed: int = 0):
    torch.manual_seed(seed)
    cfg = model_config("tiny", vocab_size=97, seq_len=64, num_key_value_heads=kv_heads, tie_word_embeddings=tied)
    model = build_model(cfg).eval()
    with torch.no_grad():  # weights far from the initial 0.02 scale, so positions and masks matter
        for p in model.parameters():
            p.normal_(0, 0.3)
    return model


def _batch(lengths=(5, 9, 2, 7), seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    rows = [torch.randint(3, 97, (n,), generator=g).tolist() for n in lengths]
    ids = pad(rows, 0, left=True)
    mask = pad([[1] * n for n in lengths], 0, ids.shape[1], left=True)
    return ids, mask


@pytest.mark.parametrize("kv_heads,tied", [(4, True), (2, False), (1, True)])
def test_steps_match_the_forward_over_a_padded_batch(kv_heads, tied):
    model = _model(kv_heads, tied)
    assert steps_in_place(model)
    ids, mask = _batch()
    pos = positions(mask)
    new = 6
    decoder = KVDecoder(model, ids.shape[1] + new)
    got = [decoder.prefill(ids, mask, pos)]
    g = torch.Generator().manual_seed(2)
    fed = torch.randint(3, 97, (ids.shape[0], new), generator=g)
    with torch.no_grad():
        for i in range(new):
            pos = pos[:, -1:] + 1
            got.append(decoder.step(fed[:, i], pos))
        # The whole sequence through the model's forward, no cache: position P - 1 + i predicts step i.
        seq = torch.cat([ids, fed], 1)
        full_mask = torch.cat([mask, torch.ones_like(fed)], 1)
        ref = model(input_ids=seq, attention_mask=full_mask, position_ids=positions(full_mask)).logits
    P = ids.shape[1]
    for i, logits in enumerate(got):
        torch.testing.assert_close(logits, ref[:, P - 1 + i], atol=2e-5, rtol=1e-4)


def test_sampling_draws_what_the_forward_path_draws():
    """The same seeded draws give the same tokens and log-probabilities through the
    decoder's steps and through ``forward`` (the path every other model takes)."""
    model = _model(2, False)
    ids, mask = _batch((3, 8, 8, 5, 1))
    torch.manual_seed(5)
    fast, fast_lp = sample_batch(model, ids, mask, 12, 1.0, eos_id=-1, pad_id=0, with_logprobs=True)
    model.register_forward_pre_hook(lambda module, args: None)  # a hooked model: steps through forward
    assert not steps_in_place(model)
    torch.manual_seed(5)
    slow, slow_lp = sample_batch(model, ids, mask, 12, 1.0, eos_id=-1, pad_id=0, with_logprobs=True)
    assert torch.equal(fast, slow)
    torch.testing.assert_close(fast_lp, slow_lp, atol=1e-5, rtol=1e-5)


def test_a_single_prompt_streams_as_greedy_generate():
    model = _model()
    prompt = [5, 17, 40, 3, 88]
    got = list(stream_tokens(model, prompt, SamplingParams(max_new_tokens=15, temperature=0)))
    ref = model.generate(input_ids=torch.tensor([prompt]), do_sample=False, max_new_tokens=15,
                         eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    assert got == ref and len(got) == 15


def test_an_int8_model_steps_in_place_and_matches_its_forward():
    from crawl2chat.stages.inference.generation import quantize_int8

    model = quantize_int8(_model())
    assert steps_in_place(model)
    prompt = [9, 4, 61, 22]
    got = list(stream_tokens(model, prompt, SamplingParams(max_new_tokens=10, temperature=0)))
    ids = torch.tensor([prompt])
    with torch.no_grad():
        ref = []
        logits, cache = forward_with_cache(model, ids)
        for _ in range(10):
            ref.append(int(logits[0, -1].argmax()))
            logits, cache = forward_with_cache(model, torch.tensor([[ref[-1]]]), cache)
    assert got == ref


def test_other_models_and_capacity():
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=97, n_positions=32, n_embd=32, n_layer=2, n_head=2)).eval()
    assert not steps_in_place(gpt2)
    got = list(stream_tokens(gpt2, [1, 2, 3], SamplingParams(max_new_tokens=5, temperature=0)))
    ref = gpt2.generate(input_ids=torch.tensor([[1, 2, 3]]), do_sample=False, max_new_tokens=5,
                        eos_token_id=None, pad_token_id=0)[0, 3:].tolist()
    assert got == ref
    model = _model()
    model.model.layers[0].mlp._hf_hook = object()  # accelerate's device hook on one module
    assert not steps_in_place(model)
    del model.model.layers[0].mlp._hf_hook
    assert steps_in_place(model)
    scaling = model.model.layers[1].self_attn.scaling
    del model.model.layers[1].self_attn.scaling  # as in transformers releases before the attribute
    assert not steps_in_place(model)
    model.model.layers[1].self_attn.scaling = scaling
    decoder = KVDecoder(model, 4)
    with pytest.raises(ValueError, match="capacity 4"):
        decoder.prefill(torch.tensor([[1, 2, 3, 4, 5]]))
    decoder.prefill(torch.tensor([[1, 2, 3]]))
    with torch.no_grad():
        decoder.step(torch.tensor([7]), torch.tensor([[3]]))
        with pytest.raises(ValueError, match="no room"):
            decoder.step(torch.tensor([7]), torch.tensor([[4]]))
