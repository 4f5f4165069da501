"""docker-compose.yml, checked by parsing (no Docker engine runs here)."""

from __future__ import annotations

from typing import Any

import yaml

from tests.conftest import REPO


def compose() -> dict[str, Any]:
    return yaml.safe_load((REPO / "docker-compose.yml").read_text())


def test_postgres_has_volume_health_check_and_no_default_secret() -> None:
    db = compose()["services"]["postgres"]
    assert any(v.endswith(":/var/lib/postgresql/data") for v in db["volumes"])
    assert "pg_isready" in " ".join(db["healthcheck"]["test"])
    password = db["environment"]["POSTGRES_PASSWORD"]
    assert password.startswith("${HPO_DB_PASSWORD:?")  # required, no default value
    assert all(p.startswith("${HPO_DB_BIND:-127.0.0.1}:") for p in db["ports"])


def test_dashboard_and_worker_share_the_database() -> None:
    services = compose()["services"]
    for name in ("dashboard", "worker"):
        service = services[name]
        assert service["depends_on"]["postgres"]["condition"] == "service_healthy"
        url = service["environment"]["HPO_STORAGE"]
        assert (
            url.startswith("postgresql+psycopg2://hpo:${HPO_DB_PASSWORD:?") and "@postgres:" in url
        )
    assert services["dashboard"]["ports"] == ["127.0.0.1:8080:8080"]
    assert services["dashboard"]["command"][0] == "dashboard"


def test_worker_reserves_gpus_and_runs_a_shipped_config() -> None:
    worker = compose()["services"]["worker"]
    devices = worker["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]
    command = worker["command"]
    assert command[:2] == ["run", "--study"]
    assert command[command.index("--gpus") + 1] == "auto"  # one worker process per GPU
    # SIGTERM hands the running trial back within stop_timeout (30 s) before Docker kills it.
    assert worker["init"] is True and worker["stop_grace_period"] == "60s"
    config = command[command.index("--config") + 1]
    default = config.split(":-")[1].rstrip("}")
    assert (REPO / "configs" / default).is_file()
    assert "COPY configs" in (REPO / "Dockerfile").read_text()
