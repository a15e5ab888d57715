"""docker-compose.yml's secrets and users, read from the file itself (no Docker engine
runs here): every secret is required, the .env.example placeholders are refused by
the check every service waits for (the script runs here for real), no password sits
on a command line, MLflow and the pipeline use MinIO users of their own, and every
long-running container runs as a non-root user."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
COMPOSE_TEXT = (ROOT / "docker-compose.yml").read_text()
SERVICES = yaml.safe_load(COMPOSE_TEXT)["services"]
CHECK = ROOT / "infra" / "compose" / "check-env.sh"
EXAMPLE = ROOT / ".env.example"


def example_values() -> dict[str, str]:
    pairs = (line.split("=", 1) for line in EXAMPLE.read_text().splitlines() if "=" in line and not line.startswith("#"))
    return {k: v for k, v in pairs}


SECRETS = [k for k in example_values() if re.search(r"PASSWORD|SECRET|TOKEN", k)]


def _depends(name: str) -> set[str]:
    deps = SERVICES[name].get("depends_on") or {}
    return set(deps if isinstance(deps, (list, dict)) else [])


def test_every_secret_is_required_wherever_compose_reads_it():
    assert {"POSTGRES_PASSWORD", "MINIO_ROOT_PASSWORD", "MINIO_MLFLOW_PASSWORD", "MINIO_PIPELINE_PASSWORD",
            "RAY_AUTH_TOKEN"} <= set(SECRETS)
    for name in SECRETS:
        uses = re.findall(r"\$\{" + name + r"(\S{0,2})", COMPOSE_TEXT)
        assert uses, f"{name} is never used"
        assert all(u == ":?" for u in uses), f"{name} is read without ${{{name}:?...}} somewhere"
    assert "change-me" not in COMPOSE_TEXT and "replace-with" not in COMPOSE_TEXT


def test_every_service_waits_for_the_secret_check():
    for name in SERVICES:
        if name == "check-env":
            continue
        seen, todo = set(), [name]
        while todo:
            for dep in _depends(todo.pop()) - seen:
                seen.add(dep)
                todo.append(dep)
        assert "check-env" in seen, f"{name} can start without check-env"
    deps = SERVICES["postgres"]["depends_on"]
    assert deps["check-env"]["condition"] == "service_completed_successfully"
    assert SERVICES["check-env"]["entrypoint"][-2:] == ["/check/check-env.sh", "/check/env.example"]


def _check(env: dict[str, str]) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if k not in SECRETS}
    return subprocess.run(["sh", str(CHECK), str(EXAMPLE)], env={**clean, **env}, capture_output=True, text=True,
                          timeout=30)


def test_placeholder_short_and_missing_secrets_are_refused():
    placeholders = _check({k: example_values()[k] for k in SECRETS})
    assert placeholders.returncode == 1
    for name in SECRETS:
        assert f"{name} still has the placeholder value" in placeholders.stderr
    strong = {k: f"{k.lower()}-7f3a9c1e5b2d" for k in SECRETS}
    ok = _check(strong)
    assert ok.returncode == 0, ok.stderr
    short = _check({**strong, "POSTGRES_PASSWORD": "abc"})
    assert short.returncode == 1 and "POSTGRES_PASSWORD is shorter than 12" in short.stderr
    missing = _check({k: v for k, v in strong.items() if k != "RAY_AUTH_TOKEN"})
    assert missing.returncode == 1 and "RAY_AUTH_TOKEN is not set" in missing.stderr


def _as_text(value) -> str:
    return " ".join(value) if isinstance(value, list) else str(value or "")


def test_no_password_on_a_command_line():
    for name, svc in SERVICES.items():
        argv = " ".join(_as_text(svc.get(k)) for k in ("command", "entrypoint"))
        argv += " " + _as_text((svc.get("healthcheck") or {}).get("test"))
        for secret in SECRETS:
            assert secret not in argv, f"{name} puts {secret} on a command line"
        assert not re.search(r"://[^/\s:@]+:[^@\s/]+@", argv), f"{name}: a URI with a password on a command line"
    assert "MLFLOW_BACKEND_STORE_URI" in SERVICES["mlflow"]["environment"]
    init = (ROOT / "infra" / "compose" / "minio-init.sh").read_text()
    assert "MC_HOST_local" in SERVICES["minio-init"]["environment"] and "mc alias set" not in init


def test_mlflow_and_the_pipeline_use_their_own_minio_users():
    env = SERVICES["mlflow"]["environment"]
    assert "MINIO_MLFLOW_USER" in env["AWS_ACCESS_KEY_ID"] and "MINIO_MLFLOW_PASSWORD" in env["AWS_SECRET_ACCESS_KEY"]
    for name in ("prefect-worker", "ray-head", "ray-worker"):
        assert "MINIO_PIPELINE_PASSWORD" in SERVICES[name]["environment"]["AWS_SECRET_ACCESS_KEY"], name
    holders = {name for name, svc in SERVICES.items() if "MINIO_ROOT" in yaml.safe_dump(svc.get("environment"))}
    assert holders == {"minio", "minio-init", "check-env"}
    init = (ROOT / "infra" / "compose" / "minio-init.sh").read_text()
    for step in ("mc admin user add", "mc admin policy create", "mc admin policy attach", "arn:aws:s3:::$bucket/*"):
        assert step in init
    assert SERVICES["mlflow"]["depends_on"]["minio-init"]["condition"] == "service_completed_successfully"


def test_containers_run_as_non_root_users():
    for name, svc in SERVICES.items():
        user = str(svc.get("user", ""))
        if name == "minio-volume":  # the one root container only hands MinIO its volume
            assert svc["entrypoint"] == ["chown", "1000:1000", "/data"] and svc["restart"] == "no"
            continue
        assert user and user.split(":")[0] not in ("0", "root"), f"{name} runs as {user or 'the image default'}"
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert re.search(r"^USER 1000(:1000)?$", dockerfile, re.M)
