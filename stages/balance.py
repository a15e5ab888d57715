"""Language (or source) balancing: ``w = freq^alpha / size^beta``.

Web crawls are dominated by a few languages. Each group g (a language or a
source) gets a sampling weight ``w_g = f_g**alpha / s_g**beta``, where ``f_g`` is
the group's share of documents and ``s_g`` its share of the current data amount
(bytes by default). The weights define a target mixture ``p_g = w_g / sum(w)``;
each document is then kept with probability ``r_g = p_g / s_g``, scaled so the
largest rate is 1 (no group is repeated, the most over-represented ones are
thinned). With alpha=0.7, beta=0.3 and f=s the target is ``s**0.4``: a flattening
of the mixture in the spirit of temperature sampling.

The keep decision hashes the document id with a seed, so it is the same on every
worker and on every rerun.
"""

from __future__ import annotations

from typing import Literal

import xxhash
from pydantic import BaseModel, ConfigDict, Field


class BalanceConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    by: Literal["lang", "source", "none"] = Field(
        "lang", description="Group documents by language, by source, or not at all."
    )
    alpha: float = Field(0.7, ge=0, description="Exponent on a group's document frequency.")
    beta: float = Field(0.3, ge=0, description="Exponent on a group's current data amount.")
    size_unit: Literal["bytes", "documents"] = Field(
        "bytes", description="How a group's current data amount is measured."
    )
    mode: Literal["sample", "weight"] = Field(
        "sample",
        description="'sample' keeps each document with its group's rate; 'weight' keeps all and "
        "only writes the rate to the `sample_weight` column for the training sampler.",
    )
    seed: int = Field(0, description="Seed of the per-document keep decision.")


def group_keep_rates(
    doc_counts: dict[str, int], sizes: dict[str, float], alpha: float, beta: float
) -> dict[str, float]:
    """Keep rate per group, in (0, 1], from document counts and data sizes."""
    total_docs = sum(doc_counts.values())
    total_size = sum(sizes.values())
    if not total_docs or not total_size:
        return {g: 1.0 for g in doc_counts}
    freq = {g: n / total_docs for g, n in doc_counts.items()}
    share = {g: max(sizes[g], 1e-12) / total_size for g in doc_counts}
    weight = {g: freq[g] ** alpha / share[g] ** beta for g in doc_counts}
    total_weight = sum(weight.values())
    target = {g: w / total_weight for g, w in weight.items()}
    rate = {g: target[g] / share[g] for g in doc_counts}
    top = max(rate.values())
    return {g: r / top for g, r in rate.items()}


def keep_document(doc_id: str, rate: float, seed: int) -> bool:
    """Stable Bernoulli(rate) draw keyed by the document id."""
    if rate >= 1.0:
        return True
    u = xxhash.xxh64_intdigest(doc_id.encode("utf-8"), seed=seed) / 2**64
    return u < rate
