"""Policy files and the cluster's rails: the shipped policies load, a typo names its field
and file, a job's own options only make its policy stricter, and the rails every job shares
are the service's settings, never a policy's."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest

from slurm_plugin.config import Settings
from slurm_plugin.errors import ConfigError
from slurm_plugin.policy.loader import (
    JobOptions,
    active_policies,
    apply_job_overrides,
    load_policies,
    load_policy,
    policy_from_comment,
)
from slurm_plugin.policy.schema import Policy

REPO = Path(__file__).resolve().parents[2]
POLICIES = load_policies(REPO / "policies")


def test_shipped_policies_load() -> None:
    """The four shipped policies are valid and say what they do."""
    assert set(POLICIES) == {"observe", "evict", "evict-aggressive", "off"}
    assert POLICIES["observe"].actions.mode == "observe"
    assert POLICIES["evict-aggressive"].actions.when == "now"


def test_policy_from_comment_and_typos(tmp_path: Path) -> None:
    """The --comment convention selects a policy; a typo in a file names field and file."""
    assert policy_from_comment('straggler:policy=evict; x="y z"') == "evict"
    assert policy_from_comment("nothing here") is None
    bad = tmp_path / "bad.toml"
    bad.write_text("[actions]\nmax_requeue = 3\n")
    with pytest.raises(ConfigError, match=r"actions\.max_requeue") as info:
        load_policy(bad)
    assert str(bad) in str(info.value)
    with pytest.raises(ValueError, match="name"):
        Policy.model_validate({"name": "Bad Name!"})
    # Issue 25: gentle.toml saying name = "observe" silently replaced the default policy.
    directory = tmp_path / "dir"
    directory.mkdir()
    (directory / "observe.toml").write_text('[actions]\nmode = "observe"\n')
    (directory / "gentle.toml").write_text('name = "observe"\n[actions]\nmode = "evict"\n')
    with pytest.raises(ConfigError, match="a policy file is named for its policy") as info:
        load_policies(directory)
    assert "gentle.toml" in str(info.value)


def test_job_overrides_only_make_the_policy_stricter() -> None:
    """sbatch --straggler-* values apply only where stricter than the policy."""
    evict = POLICIES["evict"]
    stricter = apply_job_overrides(
        evict, JobOptions(max_requeues="1", min_slowdown="8", notify="log")
    )
    assert stricter.actions.max_requeues == 1
    assert stricter.detection.min_slowdown_pct == 8.0
    assert stricter.actions.notify == "log"
    looser = apply_job_overrides(evict, JobOptions(max_requeues="50", min_slowdown="0.5"))
    assert looser.actions.max_requeues == evict.actions.max_requeues
    assert looser.detection.min_slowdown_pct == evict.detection.min_slowdown_pct
    assert apply_job_overrides(evict, JobOptions(max_requeues="lots")) == evict


@pytest.mark.parametrize(
    "text",
    [
        "[safety]\nmax_evictions_per_hour = 1000\n",
        "[persistence]\nincidents = 2\n",
        '[actions]\nmode = "evict"\ndrain_persistent = true\n',
    ],
)
def test_a_policy_cannot_carry_cluster_rails(tmp_path: Path, text: str) -> None:
    """A policy file (which a job may pick) that sets a cluster rail is refused, naming the
    file and where the rail belongs; an applied policy that does is skipped with a problem."""
    path = tmp_path / "loose.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match="belong in the service's configuration") as info:
        load_policy(path)
    assert str(path) in str(info.value)
    data = tomllib.loads(text)
    data["name"] = "loose"
    policies, problems = active_policies(REPO / "policies", {"loose": json.dumps(data)})
    assert "loose" not in policies
    assert len(problems) == 1
    assert "belong in the service's configuration" in problems[0]


def test_the_rails_are_settings() -> None:
    """[safety], [persistence] and drain_persistent are read from the settings (TOML tables,
    JSON in the environment), validated like any setting."""
    settings = Settings(
        safety={"max_evictions_per_hour": 3},
        persistence={"incidents": 4},
        service={"drain_persistent": True},
    )
    rails = settings.rails
    assert rails.safety.max_evictions_per_hour == 3
    assert rails.persistence.incidents == 4
    assert rails.drain_persistent
    with pytest.raises(ValueError, match="max_evictions_per_hr"):
        Settings(safety={"max_evictions_per_hr": 3})
