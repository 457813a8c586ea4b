"""Prometheus metrics of the service (the `metrics` extra, installed by `make install`)."""

from __future__ import annotations

import socket
import urllib.request

import pytest

from slurm_plugin.service.metrics import Metrics


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_metrics_endpoint_serves_counters() -> None:
    """With a port, /metrics exposes the service's counters with their labels."""
    pytest.importorskip("prometheus_client", reason="the metrics extra is not installed")
    port = _free_port()
    metrics = Metrics(port)
    assert metrics.enabled
    metrics.detections.labels(kind="straggler", cause="compute").inc()
    metrics.actions.labels(action="evict", outcome="verified").inc()
    metrics.jobs.set(3)
    url = f"http://127.0.0.1:{port}/metrics"
    with urllib.request.urlopen(url, timeout=5) as response:
        body = response.read().decode()
    assert 'straggler_detections_total{cause="compute",kind="straggler"} 1.0' in body
    assert 'straggler_actions_total{action="evict",outcome="verified"} 1.0' in body
    assert "straggler_jobs_watched 3.0" in body


def test_without_a_port_metrics_are_silent() -> None:
    """Port 0 means no endpoint; every metric call is a no-op."""
    metrics = Metrics(0)
    assert not metrics.enabled
    metrics.detections.labels(kind="x", cause="y").inc()
    metrics.cycle_seconds.observe(0.1)
