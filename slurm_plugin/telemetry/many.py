"""Every running job's streams in a few round trips: the service's read of a cycle.

One pipeline asks, for every job, where its steps stream stands (``XINFO STREAM``), the steps
entries after the job's cursor and its events after theirs; a job with more entries waiting
than a page holds is read on in further pipelines, only with the jobs that still have some.
At 2,000 jobs that is a few round trips a cycle instead of ~10 per job.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

import redis

from slurm_plugin.model import keys
from slurm_plugin.store.telemetry_store import Raw, RedisClient, StreamMark, mark_of


@dataclass(frozen=True)
class Cursor:
    """Where the service stands in one job's streams."""

    job_id: str
    steps_after: str = "0-0"
    events_after: str = "0-0"


@dataclass(frozen=True)
class FirstRead:
    """One job's first page: its steps stream's mark, the steps entries and the events."""

    mark: StreamMark | None
    steps: Raw
    events: Raw


def read_first(
    client: RedisClient, cursors: Sequence[Cursor], page: int, events: int = 1000
) -> list[FirstRead]:
    """For every cursor, in one pipeline: the mark, up to ``page`` steps entries and up to
    ``events`` events after the cursors. The mark is read first: steps added after it may
    come too (the pipeline is not a transaction); the caller stops at the mark's id."""
    pipe = client.pipeline(transaction=False)
    for cursor in cursors:
        steps = keys.job_steps(cursor.job_id)
        pipe.xinfo_stream(steps)
        pipe.xrange(steps, min=f"({cursor.steps_after}", count=page)
        pipe.xrange(keys.job_events(cursor.job_id), min=f"({cursor.events_after}", count=events)
    answers = pipe.execute(raise_on_error=False)
    out = []
    for i in range(len(cursors)):
        info, steps_raw, events_raw = answers[3 * i : 3 * i + 3]
        for answer in (steps_raw, events_raw):  # only XINFO of a missing stream may fail
            if isinstance(answer, Exception):
                raise answer
        if isinstance(info, redis.ResponseError):  # no such stream yet
            mark = None
        elif isinstance(info, Exception):
            raise info
        else:
            mark = mark_of(cast("dict[Any, Any]", info))
        out.append(FirstRead(mark, cast("Raw", steps_raw), cast("Raw", events_raw)))
    return out


def read_more(client: RedisClient, wanted: Sequence[tuple[str, str, str]], page: int) -> list[Raw]:
    """For every (job, after, until), in one pipeline: the next page of steps entries."""
    pipe = client.pipeline(transaction=False)
    for job_id, after, until in wanted:
        pipe.xrange(keys.job_steps(job_id), min=f"({after}", max=until, count=page)
    return cast("list[Raw]", pipe.execute())
