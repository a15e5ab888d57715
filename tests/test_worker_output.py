"""A flow run whose worker dies keeps running: its output pipes outlive their reader.

A real child process with stdout and stderr piped to this test, as a Prefect process
worker starts a flow run; the test stops reading (closes its ends, as a killed worker
does) while the child still prints and logs through rich, as Prefect's console handler
does. The child must finish its work and exit 0.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid

CHILD = r"""
import logging, sys, time
from rich.console import Console
from rich.logging import RichHandler
from crawl2chat.infra.console import outlive_output_reader

outlive_output_reader()
log = logging.getLogger("run")
log.addHandler(RichHandler(console=Console(file=sys.stderr)))
print("started", flush=True)
time.sleep(1.0)  # the reader goes away here
for i in range(200):
    print(f"[pretrain] step {i} " + "x" * 200, flush=True)
    log.warning("step %d", i)
open(sys.argv[1], "w").write("done")
"""


def test_a_run_keeps_going_when_the_process_reading_its_output_dies(tmp_path):
    marker = tmp_path / "done"
    env = dict(os.environ, PREFECT__FLOW_RUN_ID=str(uuid.uuid4()))
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(marker)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=env)
    assert proc.stdout.readline().strip() == b"started"
    proc.stdout.close()
    proc.stderr.close()
    assert proc.wait(timeout=60) == 0
    assert marker.read_text() == "done"
