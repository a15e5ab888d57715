"""A training process started before its inputs are ready, held at a gate until they are.

A one-process training run used to start once the launching process had prepared its
data (pretraining's tokenizer and packed tokens): the rank then spent its first ~5 s
importing torch's and transformers' model machinery, with the launching process's
preparation already over, before it could read that data. Started with ``CRAWL2CHAT_START_GATE`` set
(``infra.launch.run_streaming``'s ``prepare``), the rank instead imports those
libraries while the launching process prepares, then waits for one line on its stdin:
``go`` once the data is written, anything else (end of file when the launcher failed
or died) to exit without touching its run folder. Measured on 2 cores at the Tiny
Shakespeare pretraining shape: tokenizer and packing ~5.6 s and the rank's imports
~6.4-7.6 s one after the other, both done after 6.6-7.8 s side by side (as two bare
processes); the whole 20-step ``crawl2chat pretrain`` command, seven alternated pairs on a
noisy machine: median 23.4 s against 28.3 s without the gate, the fastest 21.6 against
22.4 s (on two cores the tokenizer's own threads leave the rank little to overlap with
when nothing else runs; more cores leave it more).

Nothing measured waits at the gate: the peak-FLOP/s measurement and the training loop
start after ``go``, on cores no longer shared with the preparation.
"""

from __future__ import annotations

import importlib
import os
import sys

START_GATE_ENV = "CRAWL2CHAT_START_GATE"
GO = "go"

# What every stage's script loads before it reads its data: Accelerate, transformers'
# model base (which pulls in torch._dynamo, torch.distributed.tensor and scipy: ~3.9 s of a
# small CPU's imports after torch's) and the auto classes that load models and tokenizers.
START_IMPORTS = ("accelerate", "transformers.modeling_utils", "transformers.models.auto.modeling_auto",
                 "transformers.models.auto.tokenization_auto")


def wait_at_gate() -> bool:
    """In a process started with ``CRAWL2CHAT_START_GATE``: import :data:`START_IMPORTS`,
    then wait for the launcher's word; True to go on (also when started without the
    gate), False when the launcher went away or gave up. The variable is removed, so
    processes this one starts do not wait for a word that never comes."""
    if not os.environ.pop(START_GATE_ENV, None):
        return True
    for name in START_IMPORTS:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - the script's own import reports it where it belongs
            pass
    return sys.stdin.readline().strip() == GO
