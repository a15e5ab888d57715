"""Pretraining sized to minutes of this machine: the real training step timed here,
max_steps lowered (never raised) to what fits, the decision kept per out folder so a
rerun trains the same steps."""

from __future__ import annotations

import json

from crawl2chat.stages.settings import Config
from crawl2chat.stages.training.sizing import steps_within, time_train_step
from crawl2chat.tasks.train import SIZING_FILE, sized_settings


def tiny_settings(**changes):
    settings = Config().pretrain.train.model_dump(mode="json")
    settings.update({"preset": "tiny", "vocab_size": 256, "seq_len": 64, "micro_batch_size": 2, "warmup_steps": 5,
                     **changes})
    return settings


def test_a_timed_step_grows_with_its_batch():
    small = time_train_step(tiny_settings(), 256)
    large = time_train_step(tiny_settings(micro_batch_size=32, seq_len=128), 256)
    assert 0 < small < large


def test_steps_within_the_minutes_never_above_max_steps_nor_below_the_least():
    assert steps_within(1.0, 0.5, max_steps=1000, least=10) == 120
    assert steps_within(10.0, 0.5, max_steps=1000, least=10) == 1000
    assert steps_within(0.001, 0.5, max_steps=1000, least=10) == 10
    assert steps_within(0.001, 0.5, max_steps=4, least=10) == 4


def test_sized_settings_lowers_max_steps_and_keeps_its_decision(tmp_path, capsys):
    big = tiny_settings(max_steps=10**7)
    sized = sized_settings("pretrain", str(tmp_path), big, minutes=0.02)  # 1.2 s of steps
    assert 10 <= sized["max_steps"] < 10**7
    assert {k: v for k, v in sized.items() if k != "max_steps"} == {k: v for k, v in big.items() if k != "max_steps"}
    record = json.loads((tmp_path / SIZING_FILE).read_text())
    (key, entry), = record.items()
    assert entry["steps"] == sized["max_steps"] and entry["step_seconds"] > 0
    assert f"{sized['max_steps']} fit, of max_steps {10**7}" in capsys.readouterr().out
    # A rerun on the folder trains the decided steps, however fast the machine is now.
    (tmp_path / SIZING_FILE).write_text(json.dumps({key: {**entry, "steps": 77}}))
    assert sized_settings("pretrain", str(tmp_path), big, minutes=0.02)["max_steps"] == 77
    # Other settings or minutes are timed anew; a run that fits keeps its max_steps.
    few = sized_settings("pretrain", str(tmp_path), tiny_settings(max_steps=12), minutes=5)
    assert few["max_steps"] == 12 and "all of them fit" in capsys.readouterr().out
    assert len(json.loads((tmp_path / SIZING_FILE).read_text())) == 2


def test_only_the_main_jobs_default_preset_sizes_by_minutes():
    from crawl2chat.stages.settings import RUN_PRESETS

    assert Config().pretrain.minutes is None  # a stage command or flow trains the steps it is given
    assert RUN_PRESETS["default"][1]["pretrain.minutes"] == 3.0
    for name in ("large", "gpu"):
        assert "pretrain.minutes" not in RUN_PRESETS[name][1]
