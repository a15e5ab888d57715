"""Training over several machines of a Ray cluster (``nodes``), the way the Prefect task
launches it: a real two-node Ray cluster on this machine (two raylets on 127.0.0.1,
Ray's own ``cluster_utils``), one ``accelerate launch`` per node with its machine rank
and the first node's rendezvous address, one process each; the run matches a
one-process run of the same global batch and is recorded in MLflow like any other."""

from __future__ import annotations

import json

import numpy as np
import pytest

from crawl2chat.stages.training.settings import PretrainConfig
from crawl2chat.tasks.train import launch_training
from parallel_reference import COMMON
from test_pretrain import steps

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

STEPS = 12  # the reference's first 12 steps (constant learning rate after warmup)


@pytest.fixture(scope="module")
def cluster():
    """Two Ray nodes on the loopback address, this process connected as the driver; the
    session's local Ray (if a test started it) is started again afterwards."""
    import ray
    from ray._private import ray_constants
    from ray.cluster_utils import Cluster

    saved, had_ray = ray_constants.ENABLE_RAY_CLUSTER, ray.is_initialized()
    ray_constants.ENABLE_RAY_CLUSTER = False  # nodes on 127.0.0.1 (infra/ray_runtime.py says why)
    if had_ray:
        ray.shutdown()
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    c.add_node(num_cpus=1)
    ray.init(address=c.address, log_to_driver=False)
    try:
        assert [n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]] == ["127.0.0.1", "127.0.0.1"]
        yield c
    finally:
        ray.shutdown()
        c.shutdown()
        ray_constants.ENABLE_RAY_CLUSTER = saved
        if had_ray:
            from crawl2chat.infra.ray_runtime import ensure_ray

            ensure_ray(num_cpus=2)


def test_two_nodes_match_one_process_through_the_training_task(cluster, parallel_reference, tmp_path):
    from mlflow import MlflowClient

    from crawl2chat.infra.tracking import setup_tracking
    from crawl2chat.tasks.train import train_stage

    shared = parallel_reference
    uri = setup_tracking(tmp_path / "home", "nodes")
    # Two machines of one process, 2 sequences each: the reference's 4 a step.
    fields = {**dict(o.split("=", 1) for o in COMMON), "tokenizer": str(shared["tok"]), "micro_batch_size": 2,
              "max_steps": STEPS}
    settings = PretrainConfig(**fields).model_dump(mode="json")
    summary = train_stage("pretrain", {"data": str(shared["corpus"])}, str(tmp_path / "two_nodes"), settings,
                          num_processes=2, nodes=2)
    run_dir = tmp_path / "two_nodes" / "latest"
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["world_size"] == 2 and metrics["steps"] == STEPS
    # Each machine's launcher logged to its own file in the shared run folder.
    assert (run_dir / "train.log").is_file() and (run_dir / "train-node1.log").is_file()
    single = shared["single"]
    ref = np.array([steps(single)[s]["loss"] for s in range(1, STEPS + 1)])
    got = np.array([steps(run_dir)[s]["loss"] for s in range(1, STEPS + 1)])
    print(f"2 nodes x 1 process vs 1 process over {STEPS} steps: max rel diff {(np.abs(got - ref) / ref).max():.3g}")
    np.testing.assert_allclose(got, ref, rtol=1e-4)
    run = MlflowClient(uri).get_run(summary["run_id"])
    assert run.data.params["nodes"] == "2" and run.info.status == "FINISHED"


def test_more_nodes_than_the_cluster_has_is_refused(cluster, parallel_reference, tmp_path):
    shared = parallel_reference
    overrides = [*COMMON, f"tokenizer={shared['tok']}"]
    with pytest.raises(ValueError, match=r"nodes=3 needs 3 machines in the Ray cluster; it has 2"):
        launch_training("pretrain", {"data": str(shared["corpus"])}, str(tmp_path / "three"), max_steps=2,
                        overrides=overrides, num_processes=3, nodes=3)
    with pytest.raises(ValueError, match=r"num_processes=3 must split evenly over nodes=2"):
        launch_training("pretrain", {"data": str(shared["corpus"])}, str(tmp_path / "uneven"), max_steps=2,
                        overrides=overrides, num_processes=3, nodes=2)


def test_failures_cross_processes_whole():
    """A node's failed launch comes back from its Ray task, and a failed stage from a
    Prefect task's state, by pickling: each failure is rebuilt with its own fields and
    message, not as a deserialisation error."""
    from pathlib import Path

    import cloudpickle

    from crawl2chat.infra.launch import LaunchError
    from crawl2chat.stages.locks import FolderBusy
    from crawl2chat.stages.training.failures import StageFailed

    for err, fields in [
        (LaunchError(["accelerate", "launch"], 1, "terminate called", Path("/x/train-node1.log")),
         ("cmd", "returncode", "tail", "log_path")),
        (StageFailed("pretrain", "permanent", "bad setting", Path("/x/train.log")),
         ("stage", "kind", "message", "log_path")),
        (FolderBusy(Path("/x/run"), 123, "pretrain"), ("folder", "pid", "holder")),
    ]:
        back = cloudpickle.loads(cloudpickle.dumps(err))
        assert type(back) is type(err) and str(back) == str(err)
        assert all(getattr(back, f) == getattr(err, f) for f in fields)
