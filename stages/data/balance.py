"""Language (or source) balancing: ``w = freq^alpha / size^beta``.

Web crawls are dominated by a few languages. Each group g (a language or a
source) gets a sampling weight ``w_g = f_g**alpha / s_g**beta``, where ``f_g`` is
the group's share of documents and ``s_g`` its share of the current data amount
(bytes by default). The weights define a target mixture ``p_g = w_g / sum(w)``,
and each document carries ``sample_weight = p_g / s_g``: how much more (>1) or
less (<1) often than its natural share its group should be seen in training.
With alpha=0.7, beta=0.3 and f=s the target is ``s**0.4``: a flattening of the
mixture in the spirit of temperature sampling.

By default every document is kept and the weight is written to the shards for
the training sampler (no data is thrown away). In ``sample`` mode the shards
themselves follow the target mixture: each document is kept with probability
``sample_weight / max(sample_weight)``, so no group is repeated and the most
over-represented ones are thinned. The keep decision hashes the document id with
a seed, so it is the same on every worker and on every rerun.
"""

from __future__ import annotations


import xxhash


def group_weights(
    doc_counts: dict[str, int], sizes: dict[str, float], alpha: float, beta: float
) -> dict[str, float]:
    """``p_g / s_g`` per group: target share over current share."""
    total_docs = sum(doc_counts.values())
    total_size = sum(sizes.values())
    if not total_docs or not total_size:
        return {g: 1.0 for g in doc_counts}
    freq = {g: n / total_docs for g, n in doc_counts.items()}
    share = {g: max(sizes[g], 1e-12) / total_size for g in doc_counts}
    weight = {g: freq[g] ** alpha / share[g] ** beta for g in doc_counts}
    total_weight = sum(weight.values())
    target = {g: w / total_weight for g, w in weight.items()}
    return {g: target[g] / share[g] for g in doc_counts}


def group_keep_rates(
    doc_counts: dict[str, int], sizes: dict[str, float], alpha: float, beta: float
) -> dict[str, float]:
    """Keep rate per group in (0, 1] for ``sample`` mode: weights scaled so the largest is 1."""
    weights = group_weights(doc_counts, sizes, alpha, beta)
    top = max(weights.values(), default=1.0)
    return {g: w / top for g, w in weights.items()}


def keep_document(doc_id: str, rate: float, seed: int) -> bool:
    """Stable Bernoulli(rate) draw keyed by the document id."""
    if rate >= 1.0:
        return True
    u = xxhash.xxh64_intdigest(doc_id.encode("utf-8"), seed=seed) / 2**64
    return u < rate
