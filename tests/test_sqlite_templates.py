"""A new project folder's MLflow store starts from the machine's migrated template: the
same schema and default experiment MLflow's own migrations give, the folder's own
experiment and runs in it, nothing of the folder that made the template."""

from __future__ import annotations

import sqlite3

import mlflow

from crawl2chat.infra.tracking import setup_tracking


def _schema(db) -> dict[str, str]:
    con = sqlite3.connect(db)
    try:
        return {name: sql for name, sql in con.execute("select name, sql from sqlite_master where sql is not null")}
    finally:
        con.close()


def _experiments(db) -> list[tuple]:
    con = sqlite3.connect(db)
    try:
        return con.execute("select experiment_id, name, artifact_location, lifecycle_stage, workspace "
                           "from experiments order by experiment_id").fetchall()
    finally:
        con.close()


def test_new_mlflow_stores_start_from_the_migrated_template(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)  # MLflow's default experiment keeps its artifacts under ./mlruns
    previous_uri = mlflow.get_tracking_uri()
    try:
        setup_tracking(tmp_path / "one", "exp")  # MLflow migrates a new database
        templates = list((tmp_path / "cache" / "crawl2chat").glob(f"mlflow-{mlflow.__version__}-*.db"))
        assert len(templates) == 1
        assert _experiments(templates[0]) == []  # no folder's experiments travel
        con = sqlite3.connect(templates[0])
        assert con.execute("pragma journal_mode").fetchone()[0] == "delete"  # one self-contained file
        con.execute("create table template_mark (x int)")
        con.commit()
        con.close()

        setup_tracking(tmp_path / "two", "exp")  # copied from the (marked) template
        one, two = tmp_path / "one" / "mlflow.db", tmp_path / "two" / "mlflow.db"
        assert "template_mark" in _schema(two)
        assert {k: v for k, v in _schema(two).items() if k != "template_mark"} == _schema(one)
        default = (0, "Default", str(tmp_path / "mlruns" / "0"), "active", "default")
        assert _experiments(one)[0] == _experiments(two)[0] == default
        assert _experiments(two)[1] == (1, "exp", (tmp_path / "two" / "mlartifacts").as_uri(), "active", "default")

        with mlflow.start_run(run_name="probe") as run:
            mlflow.log_metric("loss", 1.5, step=3)
        got = mlflow.get_run(run.info.run_id)
        assert got.data.metrics == {"loss": 1.5} and got.info.experiment_id == "1"
        assert mlflow.get_tracking_uri() == f"sqlite:///{two}"
        assert list((tmp_path / "two").glob(".mlflow.db.tmp-*")) == []
    finally:
        mlflow.set_tracking_uri(previous_uri)
