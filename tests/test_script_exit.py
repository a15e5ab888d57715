"""How a training script's process ends (``stage.run_script``): with its status, its
output flushed, its other threads finished and its ``atexit`` handlers run, but
without the interpreter's teardown, during which a gloo worker thread still
releasing a collective's tensors can abort the process (``stages.lifetime.exit_now``
says how). That abort depends on timing and is not reproduced here on demand; the
script sets up its conditions (an unawaited gather of tensors carrying Python state)
and the test checks that no teardown runs at all."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import atexit, sys, threading, time
    from pathlib import Path
    import torch
    import torch.distributed as dist
    from crawl2chat.stages.training.stage import run_script

    class Teardown:
        def __del__(self):
            print("interpreter teardown", file=sys.stderr, flush=True)

    LEFT_FOR_TEARDOWN = Teardown()  # a module global: released only by a teardown

    def main(argv):
        out = Path(argv[argv.index("--out") + 1])
        out.mkdir(parents=True, exist_ok=True)
        atexit.register(lambda: (out / "atexit").write_text("ran"))
        # A thread still working when main returns is waited for, as at any Python exit.
        threading.Thread(target=lambda: (time.sleep(0.5), (out / "thread").write_text("done"))).start()
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        x = torch.ones(2_000_000)
        x.state = "gathering"  # Python state on the tensor, as ZeRO-3 keeps on its parameters
        gathered = [torch.empty_like(x)]
        dist.all_gather(gathered, x, async_op=True)  # left running, like a prefetch nobody waits for
        print("work done")  # stdout is a pipe here: block-buffered, not yet written
        if argv[0] == "fail":
            raise ValueError("field 'lr' must be positive")

    run_script(main)
""")


def run(tmp_path, mode: str) -> subprocess.CompletedProcess:
    out = tmp_path / mode
    return subprocess.run([sys.executable, "-c", SCRIPT, mode, "--out", str(out)], capture_output=True, text=True,
                          timeout=120)


def test_a_script_ends_with_its_status_output_and_exit_handlers_but_no_teardown(tmp_path):
    done = run(tmp_path, "ok")
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["work done"]
    assert (tmp_path / "ok" / "atexit").read_text() == "ran"
    assert (tmp_path / "ok" / "thread").read_text() == "done"
    assert "interpreter teardown" not in done.stderr and "terminate called" not in done.stderr

    failed = run(tmp_path, "fail")
    assert failed.returncode == 2, failed.stderr
    assert failed.stdout.splitlines() == ["work done"]
    assert failed.stderr.strip().splitlines()[-1] == "error: field 'lr' must be positive"
    assert json.loads((tmp_path / "fail" / "failure.json").read_text())["kind"] == "bad_input"
    assert (tmp_path / "fail" / "atexit").read_text() == "ran"
    assert "interpreter teardown" not in failed.stderr
