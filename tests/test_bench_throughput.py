"""The data benchmark's parts: per-input-file accounting (crawl2chat's extract step over corpus
copies, summed back to the input file each copy was made from), the whole command's settings, and
the whole command against a running Prefect server."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_throughput.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_throughput_under_test", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)


def test_copy_names_map_back_to_their_input(bench):
    assert bench.input_name("/x/clueweb-quirk-c03.warc.gz") == "clueweb-quirk.warc.gz"
    assert bench.input_name("sample-0001-c00.warc.gz") == "sample-0001.warc.gz"
    assert bench.input_name("plain.warc.gz") == "plain.warc.gz"


def test_per_input_counts_sum_the_copies_of_each_file(bench, shared_data, tmp_path):
    from crawl2chat.stages.data import pipeline as steps
    from crawl2chat.stages.data.engine import LOCAL
    from crawl2chat.stages.settings import load_config

    inputs = [str(shared_data / "warc/resiliparse/clueweb-quirk.warc.gz"),
              str(shared_data / "warc/resiliparse/warcfile.warc.gz")]
    corpus = bench.build_corpus(inputs, 2, tmp_path, distinct_bodies=True)
    cfg = load_config().data
    one = steps.extract_step(inputs[1:], str(tmp_path / "one"), cfg.extract, engine_name=LOCAL)
    both = steps.extract_step(bench.corpus_files(corpus), str(tmp_path / "both"), cfg.extract, engine_name=LOCAL)

    single = bench.per_input_counts(one.out_dir)["warcfile.warc.gz"]
    counts = bench.per_input_counts(both.out_dir)
    assert set(counts) == {"clueweb-quirk.warc.gz", "warcfile.warc.gz"}
    assert counts["warcfile.warc.gz"]["records"] == 2 * single["records"] > 0
    assert counts["warcfile.warc.gz"]["kept"] == 2 * single["kept"] > 0
    for c in counts.values():  # every record read is kept or dropped with its reason
        assert c["kept"] + sum(c["dropped"].values()) == c["records"]
    assert sum(c["kept"] for c in counts.values()) == both.kept


@pytest.mark.parametrize("extractor", ["trafilatura", "resiliparse"])
def test_the_whole_command_gets_the_per_step_settings(bench, extractor):
    """The ``--set`` flags the whole ``crawl2chat data`` command is run with, read back as the
    command reads them, give the settings the per-step side builds its steps from."""
    from crawl2chat.stages.settings import load_config, parse_overrides

    flags = bench.set_flags(bench.step_overrides(extractor))
    assert flags[::2] == ["--set"] * (len(flags) // 2)
    from_flags = load_config(overrides=parse_overrides(flags[1::2])).data
    direct = load_config(overrides=bench.step_overrides(extractor)).data
    assert from_flags == direct
    assert from_flags.extract.extractor == extractor and from_flags.langid.languages is None
    assert not from_flags.quality.c4.enabled and from_flags.quality.gopher_quality.enabled


def test_against_server_the_whole_command_reports_to_the_running_server(bench, shared_data, tmp_path):
    """``--against-server``: the whole command records its flow run on the Prefect server the
    benchmark keeps running, and starts no API server (no database) of its own."""
    import os

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from live_services import api_call, stop_group

    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_API_URL", "PREFECT_HOME"))}
    server, server_env = bench.start_server(tmp_path, env)
    try:
        api = server_env["PREFECT_API_URL"]
        assert api.startswith("http://127.0.0.1:")
        files = [str(shared_data / "warc/resiliparse/warcfile.warc.gz")]
        result = bench.whole_command(files, tmp_path / "command", "resiliparse", "auto",
                                     tmp_path / "command.log", server_env)
        assert result["final_kept"] > 0 and result["wall_total"] > 0
        runs = api_call(api, "POST", "/flow_runs/filter", {})
        assert [r["state_type"] for r in runs] == ["COMPLETED"]  # the data flow's run
        assert not list((tmp_path / "command").rglob("prefect.db"))  # no server of its own
    finally:
        stop_group(server)
    assert server.poll() is not None


def test_the_benchmarks_prefect_server_dies_with_the_benchmark(tmp_path):
    """A benchmark killed with SIGKILL (no ``finally`` runs) takes its Prefect server with it."""
    import os
    import subprocess
    import time

    code = (f"import importlib.util, os, signal, sys\n"
            f"spec = importlib.util.spec_from_file_location('b', {str(BENCH)!r})\n"
            f"b = importlib.util.module_from_spec(spec); spec.loader.exec_module(b)\n"
            f"from pathlib import Path\n"
            f"proc, env = b.start_server(Path({str(tmp_path)!r}), dict(os.environ))\n"
            f"print(proc.pid, flush=True)\n"
            f"os.kill(os.getpid(), signal.SIGKILL)\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_API_URL", "PREFECT_HOME"))}
    bench = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert bench.returncode == -9, bench.stderr[-2000:]
    server_pid = int(bench.stdout.split()[-1])
    deadline = time.time() + 10
    while time.time() < deadline:
        try:
            os.kill(server_pid, 0)
        except ProcessLookupError:
            break
        try:  # a zombie that init has not reaped yet is gone too
            if open(f"/proc/{server_pid}/stat").read().split(")")[-1].split()[0] == "Z":
                break
        except OSError:
            break
        time.sleep(0.2)
    else:
        os.kill(server_pid, 9)
        raise AssertionError(f"the Prefect server (pid {server_pid}) outlived the benchmark")
