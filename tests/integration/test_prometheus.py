"""The operators' view, for real: Debian's Prometheus scrapes the service while it evicts a
straggler on the dev cluster, and every query of the Grafana dashboard (contrib/grafana/)
returns data; the alert rules pass `promtool check rules` and their own rule tests."""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import signal
import subprocess
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from slurm_plugin.demo.run import start_service
from slurm_plugin.errors import ConfigError
from slurm_plugin.service.metrics import Metrics
from slurm_plugin.service.state import ServiceState
from tests.integration.cluster_jobs import submit
from tests.integration.conftest import SERVICE_LOG, Slurm, free_port, wait_for

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "contrib" / "grafana" / "slurm-straggler.json"
RULES = REPO / "contrib" / "prometheus"
#: Grafana's variables, as the dashboard would have them over the last hour.
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$__range": "1h", "${datasource}": "prometheus"}


def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title, PromQL) of every target of the dashboard."""
    panels = json.loads(DASHBOARD.read_text())["panels"]
    return [(p["title"], t["expr"]) for p in panels for t in p["targets"]]


def _grafana(expr: str) -> str:
    for name, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(name, value)
    return expr


@pytest.fixture
def prometheus(tmp_path: Path) -> Iterator[Callable[[int], str]]:
    """Start Debian's prometheus scraping the given port every second; yields the starter,
    which returns its API's base URL."""
    binary = shutil.which("prometheus")
    assert binary, "no prometheus (make test installs Debian's package)"
    procs: list[subprocess.Popen[bytes]] = []
    logs: list[Any] = []

    def start(target_port: int) -> str:
        port = free_port()
        config = tmp_path / "prometheus.yml"
        config.write_text(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
            "scrape_configs:\n  - job_name: straggler\n    static_configs:\n"
            f"      - targets: ['127.0.0.1:{target_port}']\n"
        )
        log = (tmp_path / "prometheus.log").open("wb")
        logs.append(log)
        procs.append(
            subprocess.Popen(
                [
                    binary,
                    f"--config.file={config}",
                    f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                    f"--web.listen-address=127.0.0.1:{port}",
                ],
                stdout=log,
                stderr=log,
            )
        )
        url = f"http://127.0.0.1:{port}"
        wait_for(lambda: _up(url), 30, "prometheus to scrape the service")
        return url

    yield start
    for proc in procs:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    for log in logs:
        log.close()


def _query(url: str, expr: str) -> list[dict[str, Any]]:
    q = urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(f"{url}/api/v1/query?{q}", timeout=10) as answer:  # noqa: S310
        body = json.loads(answer.read())
    assert body["status"] == "success", (expr, body)
    return list(body["data"]["result"])


def _up(url: str) -> bool:
    try:
        return any(float(r["value"][1]) == 1 for r in _query(url, 'up{job="straggler"}'))
    except OSError:
        return False


def _value(url: str, expr: str) -> float:
    result = _query(url, expr)
    return sum(float(r["value"][1]) for r in result)


def test_every_dashboard_query_answers_during_an_eviction(
    slurm: Slurm,
    job_dir: Path,
    state: ServiceState,
    env: dict[str, str],
    tmp_path: Path,
    request: pytest.FixtureRequest,
    prometheus: Callable[[int], str],
    record_property: Callable[[str, object], None],
) -> None:
    metrics_port = free_port()
    request.node.stash[SERVICE_LOG] = tmp_path / "service.log"
    proc, log = start_service(
        {**env, "STRAGGLER_SERVICE_METRICS_PORT": str(metrics_port)}, tmp_path / "service.log"
    )
    try:
        url = prometheus(metrics_port)
        job = submit(slurm, job_dir, "evict")
        slurm.wait_job(job, "RUNNING")

        def verified() -> bool:
            found = [d for d in state.job_decisions(job) if d.get("action") == "evict"]
            return any(d.get("state") == "verified" for d in found)

        wait_for(verified, 150, "the eviction")
        # Two scrapes after it, and a minute's rate window with samples on both sides.
        wait_for(
            lambda: _value(url, 'sum(straggler_actions_total{action="evict"})') >= 1,
            30,
            "Prometheus to scrape the eviction",
        )
        empty: list[tuple[str, str]] = []

        def every_query_answers() -> bool:
            empty[:] = [
                (title, expr)
                for title, expr in dashboard_queries()
                if not _query(url, _grafana(expr))
            ]
            return not empty

        # Rates need samples on both sides of the eviction: a scrape or two after it.
        wait_for(every_query_answers, 30, "every dashboard query to have data")
        assert empty == [], f"dashboard queries without data: {empty}"
        # The answers say what happened, not only that there is an answer.
        assert _value(url, 'sum(straggler_actions_total{action="evict",outcome="verified"})') == 1
        flagged = _query(url, "sum by (node) (straggler_node_flags_total)")
        assert {r["metric"]["node"] for r in flagged} == {"node3"}
        assert _value(url, "sum(straggler_leader)") == 1
        spent = _value(url, "sum(straggler_gpu_hours_spent_total)")
        saved = _value(url, "sum(straggler_gpu_hours_saved_total)")
        lost = _value(url, "sum(straggler_gpu_hours_lost_total)")
        assert saved > spent > 0
        assert lost > 0
        record_property("gpu_hours", {"lost": lost, "spent": spent, "saved": saved})
        record_property("queries", len(dashboard_queries()))
    finally:
        proc.kill()
        proc.wait()
        log.close()
        slurm.cancel_all()


def test_alert_rules_pass_promtool() -> None:
    promtool = shutil.which("promtool")
    assert promtool, "no promtool (Debian's prometheus package)"
    checked = subprocess.run(
        [promtool, "check", "rules", str(RULES / "straggler-alerts.yml")],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "SUCCESS: 6 rules found" in checked.stdout
    tested = subprocess.run(
        [promtool, "test", "rules", "straggler-alerts.test.yml"],
        cwd=RULES,
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    assert tested.returncode == 0, tested.stdout + tested.stderr


def test_the_dashboard_names_only_metrics_the_service_exports() -> None:
    """A renamed metric would leave a panel empty in every cluster: each metric the dashboard
    (and each alert) queries is one the service's endpoint declares."""
    port = free_port()
    Metrics(port=port)
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as answer:
        text = answer.read().decode()
    declared = {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")}
    series = declared | {f"{n}_{s}" for n in declared for s in ("bucket", "sum", "count")}
    rules = (RULES / "straggler-alerts.yml").read_text()
    exprs = [expr for _, expr in dashboard_queries()] + [rules]
    used = set(re.findall(r"\bstraggler_[a-z_]+", " ".join(exprs)))
    assert used, "no metric found in the dashboard"
    assert used - series == set()


def _listening(port: int) -> set[str]:
    """The local addresses (hex, as the kernel writes them) that listen on TCP ``port``."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                address, hex_port = local.rsplit(":", 1)
                if int(hex_port, 16) == port and state == "0A":  # LISTEN
                    found.add(address)
    return found


def test_the_metrics_endpoint_listens_where_it_is_told_loopback_by_default() -> None:
    """Issue 38, item 9: the endpoint (job ids, node names) bound every address with no
    setting for it; it listens on loopback unless ``service.metrics_address`` says more, and
    a port in use is one clear error."""
    port = free_port()
    Metrics(port=port)
    assert _listening(port) == {"0100007F"}  # 127.0.0.1 only
    everywhere = free_port()
    Metrics(port=everywhere, address="0.0.0.0")  # noqa: S104 - what the test asks for
    assert _listening(everywhere) == {"00000000"}
    with pytest.raises(ConfigError, match=rf"metrics endpoint 127.0.0.1:{port}: .*in use"):
        Metrics(port=port)
