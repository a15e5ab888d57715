"""The contrastive stage: InfoNCE against a hand computation, the queue and momentum
encoder's arithmetic, and their exact round trip through a checkpoint (JSON +
safetensors, never pickles)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from crawl2chat.stages.training.contrastive import ContrastiveLoss, MomentumBank, info_nce


def _tiny_bert():
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    return BertModel(BertConfig(vocab_size=40, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                intermediate_size=32, max_position_embeddings=16, type_vocab_size=1),
                     add_pooling_layer=False)


def test_info_nce_equals_a_hand_computation():
    torch.manual_seed(1)
    q, k, queue = (F.normalize(torch.randn(n, 4), dim=-1) for n in (3, 3, 5))
    T = 0.05

    def by_hand(extra_for, weight=1.0):
        total = 0.0
        for i in range(3):
            pos = math.exp(float(q[i] @ k[i]) / T)
            den = sum(math.exp(float(q[i] @ k[j]) / T) for j in range(3))
            den += weight * sum(math.exp(float(q[i] @ n) / T) for n in extra_for(i))
            total += -math.log(pos / den)
        return total / 3

    assert info_nce(q, k, temperature=T).item() == pytest.approx(by_hand(lambda i: []), rel=1e-5)
    assert info_nce(q, k, queue, T).item() == pytest.approx(by_hand(lambda i: list(queue)), rel=1e-5)
    # Hard negatives: each query's 2 most similar queue rows only, each weighted 3x.
    top = lambda i: [queue[j] for j in (queue @ q[i]).topk(2).indices]  # noqa: E731
    assert info_nce(q, k, queue, T, hard_negatives=2, hard_negative_weight=3.0).item() == pytest.approx(
        by_hand(top, 3.0), rel=1e-5)


def test_queue_is_a_ring_and_momentum_update_is_an_average():
    online = _tiny_bert()
    bank = MomentumBank(online, size=5, momentum=0.9, pooling="mean", device="cpu")
    old = [p.clone() for p in bank.encoder.parameters()]
    with torch.no_grad():
        for p in online.parameters():
            p.add_(1.0)
    bank.update(online)
    for o, m, p in zip(old, bank.encoder.parameters(), online.parameters()):
        assert torch.allclose(m, 0.9 * o + 0.1 * p, atol=1e-6)  # new = 0.9 old + 0.1 online
    assert bank.negatives() is None
    bank.enqueue(torch.ones(3, 16))
    bank.enqueue(2 * torch.ones(3, 16))  # wraps: rows 3, 4, then 0
    assert (bank.ptr, bank.filled) == (1, 5)
    assert bank.queue[:, 0].tolist() == [2, 1, 1, 2, 2]
    bank.enqueue(torch.arange(7.0)[:, None].expand(7, 16))  # more than the queue holds: the newest 5
    assert bank.queue[:, 0].tolist() == [6, 2, 3, 4, 5] and bank.ptr == 1  # 2..6 written from row 1 on


def test_training_loss_enqueues_momentum_embeddings_and_sees_two_dropout_views():
    from crawl2chat.stages.training.settings import ContrastiveConfig

    online = _tiny_bert()
    online.config.hidden_dropout_prob = 0.1
    cfg = ContrastiveConfig(queue_size=8, micro_batch_size=4)
    bank = MomentumBank(online, 8, 0.9, "mean", "cpu")
    loss_fn = ContrastiveLoss(cfg, pad_id=0, bank=bank)
    ids = torch.randint(1, 40, (4, 10))
    online.train()
    loss, n = loss_fn(online, {"input_ids": ids})
    loss.backward()
    assert n == 4 and math.isfinite(loss.item()) and bank.filled == 4
    assert torch.allclose(bank.queue[:4], bank.encode(ids, torch.ones_like(ids)))


def test_queue_and_momentum_encoder_survive_a_checkpoint_bitwise(tmp_path):
    from crawl2chat.stages.training.trainer import JsonStateAccelerator

    acc = JsonStateAccelerator(cpu=True)
    online = _tiny_bert()
    bank = MomentumBank(online, size=6, momentum=0.9, pooling="mean", device="cpu")
    with torch.no_grad():
        for p in online.parameters():
            p.mul_(1.5)
    bank.update(online)
    bank.enqueue(torch.randn(4, 16))
    acc.register_for_checkpointing(bank)
    acc.save_state(str(tmp_path / "ckpt"), safe_serialization=True)
    names = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    assert "custom_state_0.json" in names and "custom_state_0.safetensors" in names
    assert not any(n.endswith(".pkl") and n.startswith("custom") for n in names)
    saved_q, saved_enc = bank.queue.clone(), {k: v.clone() for k, v in bank.encoder.state_dict().items()}
    bank.enqueue(torch.randn(5, 16))  # the run goes on, then is "killed" and restarted
    bank.update(_tiny_bert())
    acc.load_state(str(tmp_path / "ckpt"))
    assert (bank.ptr, bank.filled) == (4, 4) and torch.equal(bank.queue, saved_q)
    assert all(torch.equal(v, saved_enc[k]) for k, v in bank.encoder.state_dict().items())


def test_settings_validate_queue_and_hard_negatives():
    from pydantic import ValidationError

    from crawl2chat.stages.training.settings import MAX_QUEUE, ContrastiveConfig

    c = ContrastiveConfig()
    assert (c.temperature, c.queue_size, c.momentum, c.pooling) == (0.05, 65536, 0.9, "mean")
    with pytest.raises(ValidationError):
        ContrastiveConfig(queue_size=MAX_QUEUE + 1)
    with pytest.raises(ValidationError):
        ContrastiveConfig(queue_size=16, hard_negatives=32)
