"""Training over several machines of a Ray cluster (``nodes``), the way the Prefect task
launches it: a real two-node Ray cluster on this machine (two raylets on 127.0.0.1,
Ray's own ``cluster_utils``), one ``accelerate launch`` per node with its machine rank
and the first node's rendezvous address, one process each; the run matches a
one-process run of the same global batch and is recorded in MLflow like any other."""

from __future__ import annotations

import json

import numpy as np
import pytest

from crawl2chat.stages.training.pretrain import prepare_data
from crawl2chat.stages.training.settings import PretrainConfig
from crawl2chat.tasks.train import launch_training
from test_pretrain import BASE, corpus_text, steps

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

STEPS = 12
COMMON = [*BASE, "schedule=constant", "checkpoint_every=0", "eval_every=0"]


@pytest.fixture(scope="module")
def cluster():
    """Two Ray nodes on the loopback address, this process connected as the driver."""
    import ray
    from ray._private import ray_constants
    from ray.cluster_utils import Cluster

    saved = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False  # nodes on 127.0.0.1 (infra/ray_runtime.py says why)
    if ray.is_initialized():
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


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    root = tmp_path_factory.mktemp("nodes")
    corpus = root / "corpus.txt"
    corpus.write_text(corpus_text(3000))
    tok_dir, _ = prepare_data(PretrainConfig(vocab_size=320, val_fraction=0.1), corpus, root / "prep")
    return {"root": root, "corpus": corpus, "tok": tok_dir}


def test_two_nodes_match_one_process_through_the_training_task(cluster, shared, tmp_path):
    from mlflow import MlflowClient

    from crawl2chat.infra.tracking import setup_tracking
    from crawl2chat.tasks.train import train_stage

    single = shared["root"] / "single"
    launch_training("pretrain", {"data": str(shared["corpus"])}, str(single), max_steps=STEPS,
                    overrides=[*COMMON, f"tokenizer={shared['tok']}", "micro_batch_size=4"])

    uri = setup_tracking(tmp_path / "home", "nodes")
    fields = {**dict(o.split("=", 1) for o in COMMON), "tokenizer": str(shared["tok"]), "micro_batch_size": 2,
              "max_steps": STEPS}
    settings = PretrainConfig(**fields).model_dump(mode="json")
    summary = train_stage("pretrain", {"data": str(shared["corpus"])}, str(shared["root"] / "two_nodes"), settings,
                          num_processes=2, nodes=2)
    run_dir = shared["root"] / "two_nodes" / "latest"
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["world_size"] == 2 and metrics["steps"] == STEPS
    # Each machine's launcher logged to its own file in the shared run folder.
    assert (run_dir / "train.log").is_file() and (run_dir / "train-node1.log").is_file()
    ref = np.array([steps(single)[s]["loss"] for s in range(1, STEPS + 1)])
    got = np.array([steps(run_dir)[s]["loss"] for s in range(1, STEPS + 1)])
    print(f"2 nodes x 1 process vs 1 process over {STEPS} steps: max rel diff {(np.abs(got - ref) / ref).max():.3g}")
    np.testing.assert_allclose(got, ref, rtol=1e-4)
    run = MlflowClient(uri).get_run(summary["run_id"])
    assert run.data.params["nodes"] == "2" and run.info.status == "FINISHED"


def test_more_nodes_than_the_cluster_has_is_refused(cluster, shared, tmp_path):
    with pytest.raises(ValueError, match=r"nodes=3 needs 3 machines in the Ray cluster; it has 2"):
        launch_training("pretrain", {"data": str(shared["corpus"])}, str(tmp_path / "three"), max_steps=2,
                        overrides=[*COMMON, f"tokenizer={shared['tok']}"], num_processes=3, nodes=3)
    with pytest.raises(ValueError, match=r"num_processes=3 must split evenly over nodes=2"):
        launch_training("pretrain", {"data": str(shared["corpus"])}, str(tmp_path / "uneven"), max_steps=2,
                        overrides=[*COMMON, f"tokenizer={shared['tok']}"], num_processes=3, nodes=2)
