"""Pure parsers of Slurm output."""

from __future__ import annotations

import json

import pytest

from slurm_plugin.errors import SlurmError
from slurm_plugin.slurm.parsers import (
    collect_hostlist,
    expand_hostlist,
    parse_scontrol_record,
    parse_squeue_json,
)

# Captured from `scontrol -o show job` on the dev cluster (Slurm 22.05.8), shortened.
JOB_LINE = (
    "JobId=3 JobName=wrap UserId=root(0) GroupId=root(0) MCS_label=N/A Priority=1 "
    "JobState=RUNNING Reason=None Dependency=(null) Requeue=1 Restarts=1 BatchFlag=1 "
    "ExitCode=0:0 Partition=debug ReqNodeList=(null) ExcNodeList=node3 NodeList=node[1-2,4] "
    "BatchHost=node1 NumNodes=3 Comment=straggler: slow GPU [dec-1] x=y "
    "Command=(null) WorkDir=/tmp/a b StdOut=/tmp/a b/job.log"
)


def test_job_line_fields() -> None:
    """Fields are split at `Key=` boundaries, so values with spaces survive."""
    record = parse_scontrol_record(JOB_LINE)
    assert record["JobId"] == "3"
    assert record["Restarts"] == "1"
    assert record["NodeList"] == "node[1-2,4]"
    assert record["Comment"] == "straggler: slow GPU [dec-1] x=y"
    assert record["WorkDir"] == "/tmp/a b"
    assert record["StdOut"] == "/tmp/a b/job.log"


@pytest.mark.parametrize("line", ["", "   ", "garbage without fields"])
def test_bad_records_raise(line: str) -> None:
    """Empty or field-less output is a SlurmError, not an empty dict."""
    with pytest.raises(SlurmError):
        parse_scontrol_record(line)


def test_hostlists() -> None:
    """Hostlists expand and collect with Slurm's syntax; (null) means none."""
    assert expand_hostlist("node[1-2,4]") == ["node1", "node2", "node4"]
    assert expand_hostlist("(null)") == []
    assert collect_hostlist(["node1", "node2", "node4"]) == "node[1-2,4]"
    with pytest.raises(SlurmError, match="bad hostlist"):
        expand_hostlist("node[3-")


def test_a_count_that_is_no_finite_number_is_no_count() -> None:
    """JSON's Infinity and NaN, or an integer past any float, in a count (the fuzz test found
    int(inf) raising OverflowError): read as unset, never a crash of the cycle."""
    text = json.dumps(
        {
            "jobs": [
                {
                    "job_id": 1,
                    "restart_cnt": float("inf"),
                    "node_count": 10**400,
                    "priority": float("nan"),
                }
            ]
        }
    )
    (job,) = parse_squeue_json(text)
    assert (job.restarts, job.node_count, job.priority) == (0, 0, None)
