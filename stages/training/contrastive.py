"""Contrastive sentence embeddings: text -> a BERT encoder trained SimCSE-style.

Run under accelerate::

    accelerate launch -m crawl2chat.stages.training.contrastive --data DIR_OR_TEXT_FILE --out OUT \\
        [--max-steps N] [--set temperature=0.05 --set queue_size=4096 --set hard_negatives=64 ...]

``--data`` is a data-stage output folder or a plain text file, prepared as in
:mod:`~crawl2chat.stages.training.mlm` (a WordPiece tokenizer trained on it and
the text packed into ``OUT/data``), or, with ``init_encoder`` set to an ``mlm``
model folder, packed with that model's tokenizer and trained from its weights.
Optimizer, schedule, checkpoints, exact resume and rollback are the shared
:class:`~crawl2chat.stages.training.trainer.Trainer`'s.

**Positives.** A data folder's near-duplicate clusters are free positive pairs:
the data stage quarantines every document that MinHash (or the exact hash)
found to copy another with ``dup_cluster`` naming the document its cluster kept
(``rejected/`` files its manifest lists). Each cluster gives one pair, the first
dropped copy and the kept document, written with its tokens to
``OUT/pairs.parquet``; a pair is held out when the packed split holds out the kept
document, so held-out pairs are texts training never saw. With ``positives:
clusters`` (or ``auto`` and at least ``micro_batch_size`` training pairs) a
training row is a pair: the copy is the query, the kept document its positive.
Otherwise (``dropout``, or ``auto`` on a text file or a folder without enough
clusters) a row is ``<|cls|>`` + a window of ``seq_len - 2`` tokens + ``<|sep|>``
at an offset drawn from the batch index, and its positive is the same window
encoded again: unsupervised SimCSE (Gao et al., 2021), the dropout masks being
the only augmentation. Cluster pairs go through dropout too.

**Loss.** The sentence embedding is the mean of the token states (``pooling:
mean``) or the ``<|cls|>`` state (``pooling: cls``), L2-normalised. For queries
``q`` and positives ``k`` the loss is InfoNCE::

    -log  exp(q_i.k_i / T) / (sum_j exp(q_i.k_j / T) + w * sum_{n in N_i} exp(q_i.n / T))

with ``T = temperature``, the batch's other positives as negatives and ``N_i``
the queue: the last ``queue_size`` embeddings of a momentum encoder (MoCo, He et
al., 2020), a copy of the encoder updated after every optimizer step as
``momentum * momentum_encoder + (1 - momentum) * encoder`` (0.9 / 0.1) whose
embeddings of each step's positives join the queue after that step. A negative
that is the query's own text is no negative: queue rows and batch rows of the
same pair, or of a window overlapping the query's, are left out. With
``hard_negatives = k`` only each query's k most similar queue rows count;
``w = hard_negative_weight``. Queue, the text each row came from, its position
and the momentum encoder are checkpointed (``custom_state_2.json`` +
``custom_state_2.safetensors``), so a resumed or rolled-back run goes on exactly
as an uninterrupted one.

**Evaluation.** Retrieval among held-out positive pairs: the held-out cluster
pairs where there are at least two, else the two halves of each held-out
document (of each held-out paragraph or line of a text file);
``retrieval_positives`` says which. Each query's positive is ranked among all
pairs' second members by cosine similarity: ``retrieval_top1`` and
``retrieval_mrr``, beside ``initial_retrieval_top1`` and
``initial_retrieval_mrr`` of the encoder before training and what a random
ranking scores (``retrieval_chance_top1`` = 1/n, ``retrieval_chance_mrr`` =
H_n/n). ``val_loss`` is the InfoNCE of the held-out pairs (of held-out windows
against each other when there are no pairs).

Outputs: ``OUT/model`` (``AutoModel`` and ``AutoTokenizer`` load it; the
pooling is recorded in its config as ``sentence_pooling``), ``OUT/metrics.jsonl``
and ``OUT/metrics.json``.
"""

from __future__ import annotations

import copy
import json
import math
import os
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from crawl2chat.stages.training.encoders import CorruptedWindows, bert_config, build, prepare_data
from crawl2chat.stages.training.models import model_folder_problem
from crawl2chat.stages.training.settings import ContrastiveConfig
from crawl2chat.stages.training.stage import run_script

DEDUP_REASONS = ("dedup:near", "dedup:exact")  # near duplicates first: exact copies are easy positives
PAIRS_FILE = "pairs.parquet"  # in OUT: the tokenised cluster pairs and their side of the split
CHARS_PER_TOKEN = 32  # a text is cut (at a space) to this many characters per wanted token before tokenising


# ---------------------------------------------------------------- embeddings and loss


def embed(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, pooling: str) -> torch.Tensor:
    """Sentence embeddings (not normalised): mean of the unmasked token states, or the first token's."""
    hidden = model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state.float()
    if pooling == "cls":
        return hidden[:, 0]
    m = attention_mask.unsqueeze(-1).to(hidden.dtype)
    return (hidden * m).sum(1) / m.sum(1).clamp(min=1)


def same_text(a: torch.Tensor, b: torch.Tensor, span: int) -> torch.Tensor:
    """``[len(a), len(b)]``: True where two rows come from the same text. Rows carry an
    integer: a cluster pair's index (``span`` 1: equal), or a window's offset in the
    packed tokens (``span`` the window length: overlapping windows share text)."""
    return (a[:, None] - b[None, :]).abs() < span


def info_nce(q: torch.Tensor, k: torch.Tensor, queue: torch.Tensor | None = None, temperature: float = 0.05,
             hard_negatives: int = 0, hard_negative_weight: float = 1.0, batch_exclude: torch.Tensor | None = None,
             queue_exclude: torch.Tensor | None = None) -> torch.Tensor:
    """Mean InfoNCE of normalised queries ``q`` against their keys ``k`` (row i's positive is
    ``k[i]``, the other rows of ``k`` its negatives) and the ``queue`` rows as further negatives:
    all of them, or each query's ``hard_negatives`` most similar, each weighted by
    ``hard_negative_weight`` in the denominator. ``batch_exclude`` ``[B, B]`` and
    ``queue_exclude`` ``[B, Q]`` (True: not a negative of that query) leave out the
    query's own text; a query's own key always stays."""
    logits = q @ k.T / temperature
    if batch_exclude is not None:
        eye = torch.eye(q.size(0), dtype=torch.bool, device=q.device)
        logits = logits.masked_fill(batch_exclude & ~eye, float("-inf"))
    if queue is not None and len(queue):
        extra = q @ queue.T / temperature
        if queue_exclude is not None:
            extra = extra.masked_fill(queue_exclude, float("-inf"))
        if 0 < hard_negatives < extra.size(1):
            extra = extra.topk(hard_negatives, dim=1).values
        if hard_negative_weight != 1.0:
            extra = extra + math.log(hard_negative_weight)
        logits = torch.cat([logits, extra], dim=1)
    return F.cross_entropy(logits, torch.arange(q.size(0), device=q.device))


class MomentumBank:
    """A momentum copy of the encoder and a ring queue of its past embeddings, each with
    the text it came from (``ids``: see :func:`same_text`).

    A step's embeddings wait (``stage``) until the step is over (``flush``, after the
    optimizer step and the momentum update): every micro-batch of a step sees the same
    queue, and the queue is never changed in place under a pending backward pass.
    Registered with the accelerator for checkpointing: the position and fill level go to
    JSON (``state_dict``), the queue's filled rows, their ids and the encoder's weights to
    safetensors (``tensor_state_dict``). Loading (a resume, a rollback) drops what was
    staged and not yet flushed."""

    def __init__(self, online: torch.nn.Module, size: int, momentum: float, pooling: str, device):
        self.encoder = copy.deepcopy(online).to(device).eval().requires_grad_(False)
        self.size, self.m, self.pooling = size, momentum, pooling
        self.queue = torch.zeros(size, online.config.hidden_size, device=device)
        self.ids = torch.zeros(size, dtype=torch.long, device=device)
        self.ptr = 0  # next row to write
        self.filled = 0  # rows holding embeddings (the first ``filled`` until the queue wraps)
        self.pending: list[tuple[torch.Tensor, torch.Tensor]] = []

    @torch.no_grad()
    def update(self, online: torch.nn.Module) -> None:
        """``momentum_encoder = m * momentum_encoder + (1 - m) * online``, parameter by parameter."""
        for pm, po in zip(self.encoder.parameters(), online.parameters()):
            pm.mul_(self.m).add_(po.detach().to(pm.dtype), alpha=1 - self.m)

    @torch.no_grad()
    def encode(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return F.normalize(embed(self.encoder, input_ids, attention_mask, self.pooling), dim=-1)

    def stage(self, keys: torch.Tensor, ids: torch.Tensor) -> None:
        self.pending.append((keys.detach(), ids.detach()))

    def flush(self) -> None:
        for keys, ids in self.pending:
            self.enqueue(keys, ids)
        self.pending = []

    @torch.no_grad()
    def enqueue(self, keys: torch.Tensor, ids: torch.Tensor) -> None:
        keys, ids = keys[-self.size:], ids[-self.size:]
        n = keys.size(0)
        rows = (self.ptr + torch.arange(n, device=self.queue.device)) % self.size
        self.queue[rows] = keys.to(self.queue.dtype)
        self.ids[rows] = ids.to(self.ids.device, torch.long)
        self.ptr = (self.ptr + n) % self.size
        self.filled = min(self.size, self.filled + n)

    def negatives(self) -> tuple[torch.Tensor, torch.Tensor] | tuple[None, None]:
        """The filled rows and their ids (views: nothing writes them before the step ends)."""
        return (self.queue[: self.filled], self.ids[: self.filled]) if self.filled else (None, None)

    def state_dict(self) -> dict:
        return {"ptr": self.ptr, "filled": self.filled, "size": self.size}

    def load_state_dict(self, state: dict) -> None:
        if state["size"] != self.size:
            raise ValueError(f"checkpoint queue has {state['size']} rows; queue_size is {self.size}")
        self.ptr, self.filled = int(state["ptr"]), int(state["filled"])
        self.pending = []

    def tensor_state_dict(self) -> dict[str, torch.Tensor]:
        return {"queue": self.queue[: self.filled].clone(), "ids": self.ids[: self.filled].clone(),
                **{f"encoder.{k}": v.clone() for k, v in self.encoder.state_dict().items()}}

    def load_tensor_state_dict(self, tensors: dict[str, torch.Tensor]) -> None:
        self.queue.zero_()
        self.ids.zero_()
        self.queue[: self.filled] = tensors["queue"].to(self.queue.device)
        self.ids[: self.filled] = tensors["ids"].to(self.ids.device)
        self.encoder.load_state_dict({k[len("encoder."):]: v for k, v in tensors.items() if k.startswith("encoder.")})


class ContrastiveLoss:
    """Training: each row's query (``input_ids``) and positive (``positive_ids``, else the
    same row: a second dropout view) in one forward pass, InfoNCE against the batch and the
    queue without the query's own text (``text_ids`` within ``span``, see :func:`same_text`),
    then the momentum embeddings of the positives (gathered from every rank) are staged for
    the queue. Evaluation (no dropout): each held-out query against the batch's positives
    (``val_loss``)."""

    def __init__(self, cfg: ContrastiveConfig, pad_id: int, bank: MomentumBank | None, span: int = 1, gather=None):
        self.cfg, self.pad, self.bank, self.span = cfg, pad_id, bank, span
        self.gather = gather or (lambda t: t)

    def __call__(self, model, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, int]:
        c = self.cfg
        ids = batch["input_ids"]
        pos = batch.get("positive_ids", ids)
        mask, pos_mask = (ids != self.pad).long(), (pos != self.pad).long()
        if not model.training:
            q = F.normalize(embed(model, ids, mask, c.pooling), dim=-1)
            k = F.normalize(embed(model, pos, pos_mask, c.pooling), dim=-1) if "positive_ids" in batch else q
            return info_nce(q, k, temperature=c.temperature), ids.size(0)
        if ids.size(1) != pos.size(1):
            raise ValueError(f"queries ({ids.size(1)}) and positives ({pos.size(1)}) differ in length")
        # One pass, so each half gets its own dropout mask.
        z = embed(model, torch.cat([ids, pos]), torch.cat([mask, pos_mask]), c.pooling)
        q, k = F.normalize(z, dim=-1).chunk(2)
        text = batch["text_ids"]
        queue, queue_ids = self.bank.negatives() if self.bank is not None else (None, None)
        loss = info_nce(q, k, queue, c.temperature, c.hard_negatives, c.hard_negative_weight,
                        batch_exclude=same_text(text, text, self.span),
                        queue_exclude=same_text(text, queue_ids, self.span) if queue is not None else None)
        if self.bank is not None:
            self.bank.stage(self.gather(self.bank.encode(pos, pos_mask)), self.gather(text))
        return loss, ids.size(0)


# ---------------------------------------------------------------- cluster pairs


def _cut(text: str, chars: int) -> str:
    """``text`` up to the last space within ``chars`` characters: tokenising the cut text
    gives the whole text's first tokens (tokenizers split words at spaces first)."""
    if len(text) <= chars:
        return text
    space = text.rfind(" ", 0, chars)
    return text[: space if space > 0 else chars]


def rejected_files(data: Path) -> list[Path]:
    """The quarantine files of a data folder's current version, as its manifest lists
    them (a folder without a manifest has none); a listed file that is gone is named."""
    from crawl2chat.stages.data.versions import load_manifest

    manifest = load_manifest(data) if data.is_dir() else None
    files = [data / r for r in (manifest or {}).get("rejected", [])]
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise FileNotFoundError(f"{data}/manifest.json names rejected files that are missing: {', '.join(missing[:3])}")
    return files


def cluster_pairs(data: Path) -> list[dict]:
    """``{cluster, query, positive}`` texts: for each near-duplicate (else exact-duplicate)
    cluster of a data folder's current version, its first dropped copy (by id) and the
    document the cluster kept. Clusters whose kept document the version no longer holds
    (superseded, or dropped by a later step) give none; so does a text file."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    from crawl2chat.stages.data.versions import iter_documents

    dropped: dict[str, tuple[int, str, str]] = {}  # cluster -> (reason rank, id, text) of its chosen copy
    for f in rejected_files(Path(data)):
        if "dup_cluster" not in pq.read_schema(f).names:  # written before the quarantine named clusters
            continue
        t = pq.read_table(f, columns=["id", "reason", "dup_cluster", "text"])
        t = t.filter(pc.and_(pc.is_in(t["reason"], value_set=pa.array(DEDUP_REASONS)), pc.is_valid(t["dup_cluster"])))
        for r in t.to_pylist():
            if not r["text"] or r["dup_cluster"] == r["id"]:
                continue
            cand = (DEDUP_REASONS.index(r["reason"]), str(r["id"]), r["text"])
            if r["dup_cluster"] not in dropped or cand[:2] < dropped[r["dup_cluster"]][:2]:
                dropped[r["dup_cluster"]] = cand
    if not dropped:
        return []
    kept = {row["id"]: row["text"] for row in iter_documents(data, ["id", "text"]) if row["id"] in dropped}
    return [{"cluster": c, "query": dropped[c][2], "positive": kept[c]} for c in sorted(dropped)
            if kept.get(c)]


def prepare_pairs(cfg: ContrastiveConfig, data: str | os.PathLike, out: Path, tok_dir: Path, data_dir: Path) -> dict:
    """``OUT/pairs.parquet``: each cluster pair's tokens (the first ``seq_len - 2`` of each
    text) and whether the packed split holds it out (by the kept document's id); kept
    when it was made for this ``seq_len``. Returns its counts."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from crawl2chat.stages.training.heldout import read_split
    from crawl2chat.stages.training.tokenizer import load_tokenizer

    path = out / PAIRS_FILE
    if path.is_file():
        meta = json.loads(pq.read_schema(path).metadata[b"crawl2chat"])
        if meta["seq_len"] == cfg.seq_len:
            return meta
    split = read_split(data_dir)
    pairs = cluster_pairs(Path(data)) if Path(data).is_dir() else []
    n = cfg.seq_len - 2
    tokenizer = load_tokenizer(tok_dir)

    def tokens(texts: list[str]) -> list[list[int]]:
        if not texts:
            return []
        enc = tokenizer([_cut(t, n * CHARS_PER_TOKEN) for t in texts], add_special_tokens=False)["input_ids"]
        return [ids[:n] for ids in enc]

    held = [split is not None and split.kind == "id_hash" and split.holds_out(p["cluster"]) for p in pairs]
    table = pa.table({"cluster": pa.array([p["cluster"] for p in pairs], pa.string()),
                      "query": pa.array(tokens([p["query"] for p in pairs]), pa.list_(pa.int32())),
                      "positive": pa.array(tokens([p["positive"] for p in pairs]), pa.list_(pa.int32())),
                      "held_out": pa.array(held, pa.bool_())})
    meta = {"seq_len": cfg.seq_len, "pairs": len(pairs), "held_out": sum(held), "train": len(pairs) - sum(held)}
    table = table.replace_schema_metadata({"crawl2chat": json.dumps(meta)})
    tmp = path.with_name(f".{PAIRS_FILE}.tmp-{os.getpid()}")
    pq.write_table(table, tmp)
    os.replace(tmp, path)
    return meta


class Pairs:
    """Micro-batches of cluster pairs: ``input_ids`` (the dropped copy), ``positive_ids``
    (the kept document), each ``<|cls|> tokens <|sep|>`` padded to ``seq_len``, and
    ``text_ids`` (the pair's index). Global batch ``i`` takes the pairs in the order of a
    permutation drawn from ``(seed, 2, i)``, its rows dealt to (micro step, rank) as the
    windows are, so a batch is a pure function of its index; with at least
    ``micro_batch_size`` training pairs a micro-batch never holds a pair twice."""

    def __init__(self, path: Path, cfg: ContrastiveConfig, tokenizer):
        import pyarrow.parquet as pq

        t = pq.read_table(path).to_pydict()
        self.cfg = cfg
        self.cls, self.sep, self.pad = tokenizer.cls_token_id, tokenizer.sep_token_id, tokenizer.pad_token_id
        rows = list(zip(t["query"], t["positive"], t["held_out"]))
        self.train = [(q, p) for q, p, h in rows if not h]
        self.held_out = [(q, p) for q, p, h in rows if h]

    def rows(self, token_lists: list[list[int]]) -> torch.Tensor:
        out = torch.full((len(token_lists), self.cfg.seq_len), self.pad, dtype=torch.long)
        for i, toks in enumerate(token_lists):
            row = [self.cls, *toks[: self.cfg.seq_len - 2], self.sep]
            out[i, : len(row)] = torch.tensor(row)
        return out

    def batch(self, batch_index: int, micro: int, rank: int, world: int) -> dict[str, torch.Tensor]:
        c, n = self.cfg, len(self.train)
        order = np.random.default_rng([c.seed, 2, batch_index]).permutation(n)
        first = (micro * world + rank) * c.micro_batch_size
        chosen = [int(order[g % n]) for g in range(first, first + c.micro_batch_size)]
        return {"input_ids": self.rows([self.train[i][0] for i in chosen]),
                "positive_ids": self.rows([self.train[i][1] for i in chosen]),
                "text_ids": torch.tensor(chosen, dtype=torch.long)}

    def eval_batches(self, rank: int, world: int):
        c = self.cfg
        mine = list(range(rank, min(len(self.held_out), c.eval_batches * c.micro_batch_size), world))
        for i in range(0, len(mine), c.micro_batch_size):
            chunk = [self.held_out[j] for j in mine[i:i + c.micro_batch_size]]
            yield {"input_ids": self.rows([q for q, _ in chunk]), "positive_ids": self.rows([p for _, p in chunk])}


# ---------------------------------------------------------------- retrieval evaluation


def _row(tokenizer, ids: list[int], max_len: int) -> list[int]:
    return [tokenizer.cls_token_id, *ids[: max_len - 2], tokenizer.sep_token_id]


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


def chance(n: int) -> dict[str, float]:
    """What ranking the positive at random among ``n`` candidates scores: top-1 1/n, MRR H_n / n."""
    return {"retrieval_chance_top1": 1 / n, "retrieval_chance_mrr": sum(1 / r for r in range(1, n + 1)) / n}


class Retrieval:
    """Top-1 accuracy and MRR of finding each query's positive among every pair's second member:
    the held-out cluster pairs when there are at least two, else held-out document halves."""

    def __init__(self, tokenizer, data: Path, data_dir: Path, cfg: ContrastiveConfig, pairs: Pairs | None):
        self.tok, self.cfg = tokenizer, cfg
        if pairs is not None and len(pairs.held_out) >= 2:
            self.source = "dedup_clusters"
            chosen = pairs.held_out[: cfg.retrieval_pairs]
        else:
            self.source = "document_halves"
            chosen = halves_pairs(data, data_dir, tokenizer, cfg.retrieval_pairs)
        self.queries = [_row(tokenizer, a, cfg.seq_len) for a, _ in chosen]
        self.positives = [_row(tokenizer, b, cfg.seq_len) for _, b in chosen]

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
    """Tokenizer, packed tokens (trained on the data, or the ``init_encoder``'s tokenizer)
    and the cluster pairs (:func:`prepare_pairs`)."""
    if cfg.init_encoder:
        init = Path(cfg.init_encoder)
        if problem := model_folder_problem(init, "encoder"):
            raise ValueError(f"init_encoder: {problem}")
        if cfg.tokenizer and Path(cfg.tokenizer).resolve() != init.resolve():
            raise ValueError("tokenizer and init_encoder are both set; the encoder brings its own tokenizer")
        from crawl2chat.stages.training.heldout import read_split

        split = read_split(init)  # an encoder that records its split keeps it: its held-out text stays unseen
        cfg = cfg.model_copy(update={"tokenizer": str(init),
                                     "val_fraction": split.val_fraction if split else cfg.val_fraction})
    tok_dir, data_dir = prepare_data(cfg, data, out, "mlm")
    prepare_pairs(cfg, data, out, tok_dir, data_dir)
    return tok_dir, data_dir


def choose_positives(cfg: ContrastiveConfig, train_pairs: int) -> str:
    """``clusters`` or ``dropout``, as ``positives`` asks and the ``train_pairs`` allow."""
    enough = train_pairs >= cfg.micro_batch_size
    if cfg.positives == "clusters" and not enough:
        raise ValueError(f"positives=clusters: the data has {train_pairs} training cluster pairs, fewer than "
                         f"micro_batch_size={cfg.micro_batch_size} (near duplicates come from a data-stage folder "
                         f"with dedup on); use positives=auto or dropout")
    return "clusters" if cfg.positives == "clusters" or (cfg.positives == "auto" and enough) else "dropout"


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
    pairs = Pairs(out / PAIRS_FILE, cfg, tokenizer)
    positives = choose_positives(cfg, len(pairs.train))
    windows = CorruptedWindows(out / "data", cfg, cfg.seq_len - 2, Rows(tokenizer), with_offsets=True)
    retrieval = Retrieval(tokenizer, Path(args.data), out / "data", cfg, pairs)
    bank = MomentumBank(model, cfg.queue_size, cfg.momentum, cfg.pooling, acc.device) if cfg.queue_size else None
    # Two cluster rows share text when they are one pair; two windows when they overlap.
    span = 1 if positives == "clusters" else cfg.seq_len - 2
    loss = ContrastiveLoss(cfg, tokenizer.pad_token_id, bank, span=span, gather=acc.gather)
    index = load_index(out / "data")
    acc.print(f"contrastive {cfg.preset}: {num_params(model) / 1e6:.2f}M parameters, vocab {len(tokenizer)}, "
              f"{index['train']['tokens']:,} training tokens, {len(pairs.train)} training and "
              f"{len(pairs.held_out)} held-out cluster pairs; positives: {positives}; retrieval on "
              f"{len(retrieval.queries)} held-out {retrieval.source.replace('_', ' ')} pairs")
    holder = {}

    def after_step() -> None:
        bank.update(acc.unwrap_model(holder["trainer"].model))
        bank.flush()

    trainer = Trainer(cfg, acc, model, out,
                      batch_fn=pairs.batch if positives == "clusters" else windows.batch, loss_fn=loss,
                      eval_batches_fn=pairs.eval_batches if len(pairs.held_out) >= 2 else windows.eval_batches,
                      eval_extra=lambda _: retrieval(acc.unwrap_model(holder["trainer"].model)),
                      after_step=after_step if bank is not None else None)
    holder["trainer"] = trainer
    if bank is not None:
        acc.register_for_checkpointing(bank)  # after the trainer's schedule and state: custom_state_2
    if latest_checkpoint(out / "checkpoints") is None:
        trainer.evaluate()  # the untrained encoder's figures (an eval record at step 0)
    summary = trainer.fit()
    initial = next((r for r in read_metrics(out / "metrics.jsonl") if r["type"] == "eval" and r["step"] == 0), {})
    summary.update({f"initial_{k}": v for k, v in initial.items() if k.startswith(("val_", "retrieval_"))})
    if len(retrieval.queries) >= 2:
        summary.update(chance(len(retrieval.queries)))
    summary.update(stage="contrastive", preset=cfg.preset, params=num_params(model), vocab_size=len(tokenizer),
                   tokenizer_type=tokenizer_family(tok_dir), tokenizer=str(tok_dir.resolve()),
                   init_encoder=str(Path(cfg.init_encoder).resolve()) if cfg.init_encoder else None,
                   data=str(Path(args.data).resolve()), data_index=str((out / "data" / INDEX).resolve()),
                   pooling=cfg.pooling, temperature=cfg.temperature, queue_size=cfg.queue_size,
                   momentum=cfg.momentum, hard_negatives=cfg.hard_negatives, positives=positives,
                   train_pairs=len(pairs.train), held_out_pairs=len(pairs.held_out),
                   queue_filled=bank.filled if bank else 0, retrieval_positives=retrieval.source,
                   retrieval_pairs=len(retrieval.queries))
    return finish(acc, trainer, tok_dir, out, summary, split=index.get("split"))


def prepare_on_host(argv: list[str]) -> None:
    from crawl2chat.stages.training.stage import resolve, stage_parser

    args = stage_parser("contrastive", __doc__).parse_args(argv)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    prepare(resolve(ContrastiveConfig, args), args.data, Path(args.out))


if __name__ == "__main__":
    run_script(main)
