"""The project configuration: YAML + overrides merged into the defaults, bad fields named."""

from __future__ import annotations

import pytest

from crawl2chat.stages.settings import SettingsError, load_config, parse_override


def test_one_nested_override_keeps_the_sections_other_defaults():
    default = load_config()
    cfg = load_config(overrides={"pretrain.train.max_steps": 7})
    assert cfg.pretrain.train.max_steps == 7
    assert cfg.pretrain.train.preset == default.pretrain.train.preset
    assert cfg.pretrain.train.seq_len == default.pretrain.train.seq_len


def test_yaml_then_flags(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("data:\n  out: from-yaml\n  dedup:\n    num_bands: 20\n")
    cfg = load_config(path, {"data.out": "from-flag"})
    assert cfg.data.out == "from-flag" and cfg.data.dedup.num_bands == 20
    assert parse_override("data.langid.languages=[en, de]") == ("data.langid.languages", ["en", "de"])


@pytest.mark.parametrize("override, named", [
    ({"data.dedup.num_bands": 0}, "data.dedup.num_bands"),
    ({"data.balance.alpha": "lots"}, "data.balance.alpha"),
    ({"pretrain.train.optimizer": "sgd"}, "pretrain.train.optimizer"),
    ({"sft.trian": {}}, "sft.trian"),
])
def test_bad_fields_are_named(override, named):
    with pytest.raises(SettingsError) as err:
        load_config(overrides=override)
    assert named in str(err.value)


def test_unreadable_or_invalid_yaml_is_a_config_error(tmp_path):
    with pytest.raises(SettingsError, match="cannot read"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("data: [unclosed\n")
    with pytest.raises(SettingsError, match="not valid YAML"):
        load_config(bad)


def test_an_override_can_switch_a_rule_off_with_null():
    cfg = load_config(overrides=dict([parse_override("data.quality.c4.min_sentences=null")]))
    assert cfg.data.quality.c4.min_sentences is None


def test_every_run_preset_is_a_valid_overlay():
    from crawl2chat.stages.settings import RUN_PRESETS

    for name, (expected, overlay) in RUN_PRESETS.items():
        cfg = load_config(overrides=overlay)
        assert expected
        for key, value in overlay.items():
            node = cfg
            for part in key.split("."):
                node = getattr(node, part)
            assert node == value, (name, key)


def test_docs_profile_changes_only_settings_left_at_their_defaults():
    from crawl2chat.stages.settings import DOCS_PROFILE, DataConfig, apply_profile

    data, changed = apply_profile(DataConfig.model_validate({"langid": {"min_score": 0.9}}), embedded_site=True)
    assert data.profile == "docs" and data.langid.min_score == 0.9 and "langid.min_score" not in changed
    assert set(changed) == set(DOCS_PROFILE) - {"langid.min_score"}
    assert data.quality.c4.min_sentences is None and data.quality.fineweb.enabled is False
    web, none = apply_profile(DataConfig(), embedded_site=False)
    assert web.profile == "web" and none == {} and web.quality.fineweb.enabled


@pytest.mark.parametrize("override, field", [
    ("pretrain.train.log_every=0", "log_every"), ("pretrain.train.rollback.spike_window=0", "spike_window"),
    ("pretrain.train.lr=0", "lr"), ("pretrain.train.grad_accum=0", "grad_accum"),
    ("pretrain.train.preset=huge", "preset"), ("sft.train.eval_batches=0", "eval_batches"),
    ("ppo.train.max_steps=0", "max_steps"), ("reward.train.seq_len=1", "seq_len"),
])
def test_out_of_range_training_settings_are_refused_naming_the_field(override, field):
    with pytest.raises(SettingsError, match=field):
        load_config(overrides=dict([parse_override(override)]))


@pytest.mark.parametrize("override", ['data.seed_urls=["ftp://127.0.0.1/"]', 'data.seed_urls=["127.0.0.1:8000"]',
                                      'data.crawl.seed_urls=["not a url"]', 'data.seed_urls=["file:///etc/passwd"]'])
def test_a_seed_that_is_not_an_http_url_is_refused_naming_the_field(override):
    with pytest.raises(SettingsError, match=r"seed_urls.*is not an http\(s\) URL with a host"):
        load_config(overrides=dict([parse_override(override)]))


def test_decoder_presets_are_the_models_presets():
    from crawl2chat.stages.training.models import PRESETS
    from crawl2chat.stages.training.settings import DECODER_PRESETS

    assert tuple(PRESETS) == DECODER_PRESETS
