"""docs/deploy.md followed step by step on this machine against the dev cluster, as root and as
the service account (contrib/deploy/check-deploy, in a private mount namespace)."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from slurm_plugin.devcluster import DevCluster
from tests.integration.conftest import REPO


@pytest.mark.skipif(os.geteuid() != 0, reason="installs into /opt and /etc (of a namespace)")
def test_the_deployment_guide_works_as_written(cluster: DevCluster, redis_url: str) -> None:
    """Every shell block of docs/deploy.md runs, in order, without error; then the installed
    unit's service runs healthy as the service account, the admin CLI works as root, the
    prolog records its check, and a Redis of another key layout is refused."""
    assert shutil.which("unshare"), "unshare (util-linux) is needed"
    done = subprocess.run(
        [str(REPO / "contrib" / "deploy" / "check-deploy")],
        env={**os.environ, "SLURM_CONF": cluster.env()["SLURM_CONF"], "REDIS_URL": redis_url},
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-6000:]
    assert "check-deploy: passed" in done.stdout, output[-6000:]
    assert "runs as straggler: service: alive" in done.stdout, output[-3000:]
