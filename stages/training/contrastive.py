"""Contrastive sentence embeddings: text -> a BERT encoder trained SimCSE-style.

Run under accelerate::

    accelerate launch -m crawl2chat.stages.training.contrastive --data DIR_OR_TEXT_FILE --out OUT \\
        [--max-steps N] [--set temperature=0.05 --set queue_size=4096 --set hard_negatives=64 ...]

``--data`` is a data-stage output folder or a plain text file, prepared as in
:mod:`~crawl2chat.stages.training.mlm` (a WordPiece tokenizer trained on it and
the text packed into ``OUT/data``), or, with ``init_encoder`` set to an ``mlm``
model folder, packed with that model's tokenizer and held-out split and trained
from its weights. A training row is ``<|cls|>`` + a window of ``seq_len - 2``
tokens + ``<|sep|>`` at an offset drawn from the batch index.

The objective is unsupervised SimCSE (Gao et al., 2021): every row goes through
the encoder twice, and the two dropout masks are the only augmentation. The
sentence embedding is the mean of the token states (``pooling: mean``) or the
``<|cls|>`` state (``pooling: cls``), L2-normalised. For a batch of queries
``q`` (first view) and keys ``k`` (second view) the loss is InfoNCE::

    -log  exp(q_i.k_i / T) / (sum_j exp(q_i.k_j / T) + w * sum_{n in N_i} exp(q_i.n / T))

with ``T = temperature``, the batch's other rows as negatives and ``N_i`` the
queue: the last ``queue_size`` embeddings of a momentum encoder (MoCo, He et
al., 2020), a copy of the encoder updated after every optimizer step as
``momentum * momentum_encoder + (1 - momentum) * encoder`` that encodes each
batch (without dropout) into the queue after its loss. With ``hard_negatives
= k`` only each query's k most similar queue entries are its negatives;
``w = hard_negative_weight``. Queue, its position and the momentum encoder are
checkpointed (``custom_state_2.json`` + ``custom_state_2.safetensors``), so a
resumed run repeats the uninterrupted one exactly.

Evaluation: retrieval among held-out positive pairs. Pairs are the data stage's
duplicate clusters where it has them (a document dropped as ``dedup:near`` or
``dedup:exact`` in ``rejected/`` and the kept document of its ``dup_cluster``),
else the two halves of each held-out document (of each held-out paragraph or line
of a text file); ``retrieval_positives`` says which. Each query's positive is
ranked among all pairs' second members by cosine similarity: ``retrieval_top1``
and ``retrieval_mrr``, beside ``initial_retrieval_top1`` and
``initial_retrieval_mrr`` of the encoder before training.

Outputs: ``OUT/model`` (``AutoModel`` and ``AutoTokenizer`` load it; the
pooling is recorded in its config as ``sentence_pooling``), ``OUT/metrics.jsonl``
and ``OUT/metrics.json``.
"""

from __future__ import annotations

import copy
import math
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from crawl2chat.stages.training.encoders import CorruptedWindows, bert_config, build, prepare_data
from crawl2chat.stages.training.settings import ContrastiveConfig
from crawl2chat.stages.training.stage import run_script

DEDUP_REASONS = ("dedup:near", "dedup:exact")  # near duplicates first: exact ones are easy positives


# ---------------------------------------------------------------- embeddings and loss


def embed(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, pooling: str) -> torch.Tensor:
    """Sentence embeddings (not normalised): mean of the unmasked token states, or the first token's."""
    hidden = model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state.float()
    if pooling == "cls":
        return hidden[:, 0]
    m = attention_mask.unsqueeze(-1).to(hidden.dtype)
    return (hidden * m).sum(1) / m.sum(1).clamp(min=1)


def info_nce(q: torch.Tensor, k: torch.Tensor, queue: torch.Tensor | None = None, temperature: float = 0.05,
             hard_negatives: int = 0, hard_negative_weight: float = 1.0) -> torch.Tensor:
    """Mean InfoNCE of normalised queries ``q`` against their keys ``k`` (row i's positive is
    ``k[i]``, the other rows of ``k`` its negatives) and the ``queue`` rows as further negatives:
    all of them, or each query's ``hard_negatives`` most similar, each weighted by
    ``hard_negative_weight`` in the denominator."""
    logits = q @ k.T / temperature
    if queue is not None and len(queue):
        extra = q @ queue.T / temperature
        if 0 < hard_negatives < extra.size(1):
            extra = extra.topk(hard_negatives, dim=1).values
        if hard_negative_weight != 1.0:
            extra = extra + math.log(hard_negative_weight)
        logits = torch.cat([logits, extra], dim=1)
    return F.cross_entropy(logits, torch.arange(q.size(0), device=q.device))


class MomentumBank:
    """A momentum copy of the encoder and a ring queue of its past embeddings.

    Registered with the accelerator for checkpointing: the position and fill level go
    to JSON (``state_dict``), the queue's filled rows and the encoder's weights to
    safetensors (``tensor_state_dict``)."""

    def __init__(self, online: torch.nn.Module, size: int, momentum: float, pooling: str, device):
        self.encoder = copy.deepcopy(online).to(device).eval().requires_grad_(False)
        self.size, self.m, self.pooling = size, momentum, pooling
        self.queue = torch.zeros(size, online.config.hidden_size, device=device)
        self.ptr = 0  # next row to write
        self.filled = 0  # rows holding embeddings (the first ``filled`` until the queue wraps)

    @torch.no_grad()
    def update(self, online: torch.nn.Module) -> None:
        """``momentum_encoder = m * momentum_encoder + (1 - m) * online``, parameter by parameter."""
        for pm, po in zip(self.encoder.parameters(), online.parameters()):
            pm.mul_(self.m).add_(po.detach().to(pm.dtype), alpha=1 - self.m)

    @torch.no_grad()
    def encode(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return F.normalize(embed(self.encoder, input_ids, attention_mask, self.pooling), dim=-1)

    @torch.no_grad()
    def enqueue(self, keys: torch.Tensor) -> None:
        keys = keys[-self.size:]
        n = keys.size(0)
        rows = (self.ptr + torch.arange(n, device=self.queue.device)) % self.size
        self.queue[rows] = keys.to(self.queue.dtype)
        self.ptr = (self.ptr + n) % self.size
        self.filled = min(self.size, self.filled + n)

    def negatives(self) -> torch.Tensor | None:
        # A copy: the queue changes in place after the loss, before its backward pass.
        return self.queue[: self.filled].clone() if self.filled else None

    def state_dict(self) -> dict:
        return {"ptr": self.ptr, "filled": self.filled, "size": self.size}

    def load_state_dict(self, state: dict) -> None:
        if state["size"] != self.size:
            raise ValueError(f"checkpoint queue has {state['size']} rows; queue_size is {self.size}")
        self.ptr, self.filled = int(state["ptr"]), int(state["filled"])

    def tensor_state_dict(self) -> dict[str, torch.Tensor]:
        return {"queue": self.queue[: self.filled].clone(),
                **{f"encoder.{k}": v.clone() for k, v in self.encoder.state_dict().items()}}

    def load_tensor_state_dict(self, tensors: dict[str, torch.Tensor]) -> None:
        self.queue.zero_()
        self.queue[: self.filled] = tensors["queue"].to(self.queue.device)
        self.encoder.load_state_dict({k[len("encoder."):]: v for k, v in tensors.items() if k.startswith("encoder.")})


class ContrastiveLoss:
    """Training: two dropout views per row, InfoNCE against the batch and the queue, then
    the batch's momentum embeddings (gathered from every rank) join the queue. Evaluation:
    one view, each held-out row against the batch's others (``val_loss``)."""

    def __init__(self, cfg: ContrastiveConfig, pad_id: int, bank: MomentumBank | None, gather=None):
        self.cfg, self.pad, self.bank = cfg, pad_id, bank
        self.gather = gather or (lambda t: t)

    def __call__(self, model, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, int]:
        c = self.cfg
        ids = batch["input_ids"]
        mask = (ids != self.pad).long()
        if not model.training:
            z = F.normalize(embed(model, ids, mask, c.pooling), dim=-1)
            return info_nce(z, z, temperature=c.temperature), ids.size(0)
        z = embed(model, torch.cat([ids, ids]), torch.cat([mask, mask]), c.pooling)  # one pass, two dropout masks
        q, k = F.normalize(z, dim=-1).chunk(2)
        queue = self.bank.negatives() if self.bank is not None else None
        loss = info_nce(q, k, queue, c.temperature, c.hard_negatives, c.hard_negative_weight)
        if self.bank is not None:
            self.bank.enqueue(self.gather(self.bank.encode(ids, mask)))
        return loss, ids.size(0)


# ---------------------------------------------------------------- retrieval evaluation


def _row(tokenizer, ids: list[int], max_len: int) -> list[int]:
    return [tokenizer.cls_token_id, *ids[: max_len - 2], tokenizer.sep_token_id]


def dedup_pairs(data: Path, limit: int) -> list[tuple[str, str]]:
    """(dropped duplicate, kept document) texts from a data-stage folder's ``rejected/`` files;
    none for a text file or a folder whose rejected rows carry no ``dup_cluster``."""
    import pyarrow.parquet as pq

    from crawl2chat.stages.data.versions import iter_documents

    files = sorted((data / "rejected").glob("*.parquet")) if data.is_dir() else []
    dropped = []
    for f in files:
        names = pq.read_schema(f).names
        if not {"reason", "dup_cluster", "text", "id"} <= set(names):
            continue
        for r in pq.read_table(f, columns=["id", "reason", "dup_cluster", "text"]).to_pylist():
            if r["reason"] in DEDUP_REASONS and r["dup_cluster"] and r["text"]:
                dropped.append(r)
    if not dropped:
        return []
    dropped.sort(key=lambda r: (DEDUP_REASONS.index(r["reason"]), str(r["id"])))
    wanted = {r["dup_cluster"] for r in dropped}
    kept = {row["id"]: row["text"] for row in iter_documents(data, ["id", "text"]) if row["id"] in wanted}
    pairs, seen = [], set()
    for r in dropped:
        if r["dup_cluster"] in kept and r["dup_cluster"] not in seen:  # one pair per cluster: distinct positives
            seen.add(r["dup_cluster"])
            pairs.append((r["text"], kept[r["dup_cluster"]]))
            if len(pairs) >= limit:
                break
    return pairs


def halves_pairs(data: Path, data_dir: Path, tokenizer, limit: int) -> list[tuple[list[int], list[int]]]:
    """The two token halves of each held-out document (paragraphs, else lines, of a text file's tail)."""
    from crawl2chat.stages.training.heldout import held_out_rows, read_split

    rows, _ = held_out_rows(read_split(data_dir), data, max_docs=limit)
    texts = [r["text"] for r in rows]
    if data.is_file():
        tail = "\n".join(texts)
        paragraphs = [p for p in tail.split("\n\n") if p.strip()]
        texts = paragraphs if len(paragraphs) > 1 else [line for line in tail.splitlines() if line.strip()]
    pairs = []
    for text in texts:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) >= 8:
            half = len(ids) // 2
            pairs.append((ids[:half], ids[half:]))
            if len(pairs) >= limit:
                break
    return pairs


class Retrieval:
    """Top-1 accuracy and MRR of finding each query's positive among every pair's second member."""

    def __init__(self, tokenizer, data: Path, data_dir: Path, cfg: ContrastiveConfig):
        self.tok, self.cfg = tokenizer, cfg
        texts = dedup_pairs(data, cfg.retrieval_pairs)
        if len(texts) >= 2:
            self.source = "dedup_clusters"
            pairs = [(tokenizer(a, add_special_tokens=False)["input_ids"],
                      tokenizer(b, add_special_tokens=False)["input_ids"]) for a, b in texts]
        else:
            self.source = "document_halves"
            pairs = halves_pairs(data, data_dir, tokenizer, cfg.retrieval_pairs)
        self.queries = [_row(tokenizer, a, cfg.seq_len) for a, _ in pairs]
        self.positives = [_row(tokenizer, b, cfg.seq_len) for _, b in pairs]
        self.model = None  # set once the trainer holds it

    def _embed(self, model, rows: list[list[int]], device) -> torch.Tensor:
        out = []
        for i in range(0, len(rows), 64):
            chunk = rows[i:i + 64]
            width = max(len(r) for r in chunk)
            ids = torch.full((len(chunk), width), self.tok.pad_token_id, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for j, r in enumerate(chunk):
                ids[j, :len(r)] = torch.tensor(r)
                mask[j, :len(r)] = 1
            out.append(F.normalize(embed(model, ids.to(device), mask.to(device), self.cfg.pooling), dim=-1))
        return torch.cat(out)

    @torch.no_grad()
    def __call__(self, model) -> dict[str, float]:
        if len(self.queries) < 2:
            return {}
        was_training = model.training
        model.eval()
        device = next(model.parameters()).device
        sims = self._embed(model, self.queries, device) @ self._embed(model, self.positives, device).T
        # Ties count against the query: an encoder that maps everything alike scores 0, not 1.
        rank = (sims >= sims.diag()[:, None]).sum(1) - 1
        model.train(was_training)
        return {"retrieval_top1": float((rank == 0).float().mean()),
                "retrieval_mrr": float((1.0 / (rank + 1).float()).mean())}


# ---------------------------------------------------------------- the run


class Rows:
    """A window -> ``{input_ids}``: ``<|cls|> window <|sep|>`` (the dropout is the augmentation)."""

    def __init__(self, tokenizer):
        self.cls, self.sep = tokenizer.cls_token_id, tokenizer.sep_token_id

    def __call__(self, window: np.ndarray, rng: np.random.Generator) -> dict[str, np.ndarray]:  # noqa: ARG002
        return {"input_ids": np.concatenate([[self.cls], window, [self.sep]]).astype(np.int64)}


def prepare(cfg: ContrastiveConfig, data: str, out: Path) -> tuple[Path, Path]:
    """Tokenizer and packed tokens: trained on the data, or the ``init_encoder``'s (with its split)."""
    if cfg.init_encoder:
        from crawl2chat.stages.training.heldout import read_split

        init = Path(cfg.init_encoder)
        if not (init / "config.json").is_file():
            raise ValueError(f"init_encoder: {init} is not a model folder (no config.json)")
        if cfg.tokenizer and Path(cfg.tokenizer).resolve() != init.resolve():
            raise ValueError("tokenizer and init_encoder are both set; the encoder brings its own tokenizer")
        split = read_split(init)
        cfg = cfg.model_copy(update={"tokenizer": str(init),
                                     "val_fraction": split.val_fraction if split else cfg.val_fraction})
    return prepare_data(cfg, data, out, "mlm")


def build_encoder(cfg: ContrastiveConfig, tokenizer):
    from transformers import BertModel

    drop = {"hidden_dropout_prob": cfg.dropout, "attention_probs_dropout_prob": cfg.dropout}
    if cfg.init_encoder:
        model = BertModel.from_pretrained(cfg.init_encoder, add_pooling_layer=False, torch_dtype=torch.float32,
                                          **drop)
        if model.config.max_position_embeddings < cfg.seq_len:
            raise ValueError(f"seq_len: {cfg.seq_len} exceeds the encoder's {model.config.max_position_embeddings} "
                             "positions")
        if cfg.grad_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
    else:
        config = bert_config(cfg.preset, len(tokenizer), cfg.seq_len, tokenizer.pad_token_id)
        config.update(drop)

        class _NoPooler:  # the pooler would be an unused parameter (and DDP refuses those)
            from_config = staticmethod(lambda c: BertModel(c, add_pooling_layer=False))

        model = build(_NoPooler, config, cfg.grad_checkpointing)
    model.config.sentence_pooling = cfg.pooling
    return model


def main(argv: list[str] | None = None) -> dict:
    from crawl2chat.stages.training.models import num_params
    from crawl2chat.stages.training.packing import INDEX, load_index
    from crawl2chat.stages.training.stage import finish, finished_summary, prepare_out, resolve, stage_parser
    from crawl2chat.stages.training.tokenizer import load_tokenizer, tokenizer_family
    from crawl2chat.stages.training.trainer import Trainer, latest_checkpoint, make_accelerator, read_metrics

    args = stage_parser("contrastive", __doc__).parse_args(argv)
    cfg = resolve(ContrastiveConfig, args)
    out = Path(args.out)
    done = finished_summary(out, cfg.max_steps)
    if done is not None:
        print(f"{out} already finished {done['steps']} steps; model in {out / 'model'}")
        return done
    acc = make_accelerator(cfg)
    prepare_out(acc, cfg, out)
    if acc.is_main_process:
        prepare(cfg, args.data, out)  # already done when prepare_on_host ran
    acc.wait_for_everyone()
    tok_dir = Path(cfg.init_encoder or cfg.tokenizer or out / "tokenizer")
    tokenizer = load_tokenizer(tok_dir)
    if tokenizer.cls_token_id is None or tokenizer.sep_token_id is None:
        raise ValueError(f"tokenizer: {tok_dir} has no cls or sep token")
    model = build_encoder(cfg, tokenizer)
    windows = CorruptedWindows(out / "data", cfg, cfg.seq_len - 2, Rows(tokenizer))
    retrieval = Retrieval(tokenizer, Path(args.data), out / "data", cfg)
    bank = MomentumBank(model, cfg.queue_size, cfg.momentum, cfg.pooling, acc.device) if cfg.queue_size else None
    loss = ContrastiveLoss(cfg, tokenizer.pad_token_id, bank, gather=acc.gather)
    index = load_index(out / "data")
    acc.print(f"contrastive {cfg.preset}: {num_params(model) / 1e6:.2f}M parameters, vocab {len(tokenizer)}, "
              f"{index['train']['tokens']:,} training tokens, {len(retrieval.queries)} held-out "
              f"{retrieval.source.replace('_', ' ')} pairs")
    holder = {}
    trainer = Trainer(cfg, acc, model, out, batch_fn=windows.batch, loss_fn=loss,
                      eval_batches_fn=windows.eval_batches,
                      eval_extra=lambda _: retrieval(acc.unwrap_model(holder["trainer"].model)),
                      after_step=(lambda: bank.update(acc.unwrap_model(holder["trainer"].model))) if bank else None)
    holder["trainer"] = trainer
    if bank is not None:
        acc.register_for_checkpointing(bank)  # after the trainer's schedule and state: custom_state_2
    if latest_checkpoint(out / "checkpoints") is None:
        trainer.evaluate()  # the untrained encoder's figures (an eval record at step 0)
    summary = trainer.fit()
    initial = next((r for r in read_metrics(out / "metrics.jsonl") if r["type"] == "eval" and r["step"] == 0), {})
    summary.update({f"initial_{k}": v for k, v in initial.items() if k.startswith(("val_", "retrieval_"))})
    summary.update(stage="contrastive", preset=cfg.preset, params=num_params(model), vocab_size=len(tokenizer),
                   tokenizer_type=tokenizer_family(tok_dir), tokenizer=str(tok_dir.resolve()),
                   init_encoder=str(Path(cfg.init_encoder).resolve()) if cfg.init_encoder else None,
                   data=str(Path(args.data).resolve()), data_index=str((out / "data" / INDEX).resolve()),
                   pooling=cfg.pooling, temperature=cfg.temperature, queue_size=cfg.queue_size,
                   momentum=cfg.momentum, hard_negatives=cfg.hard_negatives,
                   queue_filled=bank.filled if bank else 0, retrieval_positives=retrieval.source,
                   retrieval_pairs=len(retrieval.queries))
    return finish(acc, trainer, tok_dir, out, summary)


def prepare_on_host(argv: list[str]) -> None:
    from crawl2chat.stages.training.stage import resolve, stage_parser

    args = stage_parser("contrastive", __doc__).parse_args(argv)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    prepare(resolve(ContrastiveConfig, args), args.data, Path(args.out))


if __name__ == "__main__":
    run_script(main)
