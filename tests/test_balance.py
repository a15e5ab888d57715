from crawl2chat.stages.data.balance import group_keep_rates, keep_document


def test_dominant_language_is_thinned_and_rare_one_kept():
    docs = {"en": 9000, "de": 900, "ja": 100}
    sizes = {"en": 9000.0, "de": 900.0, "ja": 100.0}
    rates = group_keep_rates(docs, sizes, alpha=0.7, beta=0.3)
    assert rates["ja"] == 1.0
    assert rates["en"] < rates["de"] < rates["ja"]
    # Target mixture is proportional to share**0.4 when frequency equals size share.
    kept = {g: docs[g] * rates[g] for g in docs}
    total = sum(kept.values())
    expected = {g: (docs[g] / 10000) ** 0.4 for g in docs}
    norm = sum(expected.values())
    for g in docs:
        assert abs(kept[g] / total - expected[g] / norm) < 1e-9


def test_single_group_keeps_everything():
    assert group_keep_rates({"en": 5}, {"en": 100.0}, 0.7, 0.3) == {"en": 1.0}


def test_keep_decision_is_stable_and_matches_rate():
    ids = [f"doc-{i}" for i in range(20000)]
    first = [keep_document(i, 0.25, seed=3) for i in ids]
    assert first == [keep_document(i, 0.25, seed=3) for i in ids]
    assert abs(sum(first) / len(ids) - 0.25) < 0.02
    assert all(keep_document(i, 1.0, seed=3) for i in ids[:100])


def test_weights_are_target_share_over_current_share():
    from crawl2chat.stages.data.balance import group_weights

    docs = {"en": 800, "de": 200}
    weights = group_weights(docs, {"en": 800.0, "de": 200.0}, alpha=0.7, beta=0.3)
    # Weighted by their current share, the weights reproduce the target mixture (sums to 1).
    assert abs(weights["en"] * 0.8 + weights["de"] * 0.2 - 1.0) < 1e-9
    assert weights["de"] > 1.0 > weights["en"]
