"""docker-compose.yml parses offline and keeps its promises (pinned images,
health checks, secrets from the env file, UIs bound to 127.0.0.1 only).

No Docker engine runs here; the compose implementation validates and renders the
file without one."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
COMPOSE = shutil.which("docker-compose")
pytestmark = pytest.mark.skipif(COMPOSE is None, reason="docker-compose (Debian package) is not installed")


def render(env_file: Path) -> dict:
    proc = subprocess.run(
        [COMPOSE, "--project-directory", str(ROOT), "-f", str(ROOT / "docker-compose.yml"),
         "--env-file", str(env_file), "config"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    return yaml.safe_load(proc.stdout)


def test_compose_file_renders_with_pinned_images_and_health_checks():
    config = render(ROOT / ".env.example")
    services = config["services"]
    assert {"postgres", "minio", "mlflow", "prefect-server", "prefect-worker", "ray-head", "ray-worker"} <= set(services)
    for name, svc in services.items():
        image = svc.get("image", "")
        tag = image.rsplit(":", 1)[-1] if ":" in image else ""
        assert tag and tag != "latest", f"{name}: image {image!r} is not pinned"
    for name in ("postgres", "minio", "mlflow", "prefect-server", "ray-head"):
        assert "healthcheck" in services[name], name


def test_only_uis_are_published_and_only_on_loopback():
    services = render(ROOT / ".env.example")["services"]
    published = {}
    for name, svc in services.items():
        for port in svc.get("ports", []):
            text = port if isinstance(port, str) else f"{port.get('host_ip')}:{port.get('published')}"
            assert text.startswith("127.0.0.1:"), f"{name} publishes {text} beyond loopback"
            published[name] = text
    assert set(published) == {"minio", "mlflow", "prefect-server", "ray-head"}


def test_secrets_come_from_the_env_file(tmp_path):
    text = (ROOT / "docker-compose.yml").read_text()
    assert "change-me" not in text  # no default secret in the compose file itself
    empty = tmp_path / "empty.env"
    empty.write_text("")
    proc = subprocess.run(
        [COMPOSE, "--project-directory", str(ROOT), "-f", str(ROOT / "docker-compose.yml"),
         "--env-file", str(empty), "config"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode != 0
    assert "POSTGRES_USER" in proc.stderr or "POSTGRES_PASSWORD" in proc.stderr
