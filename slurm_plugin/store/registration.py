"""A job's registration, ``stg:job:{J}:meta``: written by the prolog, read by the service, and
owned here. Every field name is a constant of this module; the prolog writes through
:func:`register` and the service reads through :func:`read_many`.

Fields: ``policy`` (the job's explicit choice, "" for none), ``nodes`` (SLURM_NODELIST),
``user``, ``attempt`` (SLURM_RESTART_COUNT), ``run`` (SLURM_JOB_SLUID, the run's unique id
from Slurm 25.11 on; empty before), ``registered_at`` and, only when the job gave
them, its own options (``sbatch --straggler-*``): ``max_requeues``, ``min_slowdown``,
``notify``, ``recovery``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

from slurm_plugin.model import keys
from slurm_plugin.model.records import to_text
from slurm_plugin.policy.loader import JobOptions

POLICY = "policy"
NODES = "nodes"
USER = "user"
ATTEMPT = "attempt"
RUN = "run"
REGISTERED_AT = "registered_at"
MAX_REQUEUES = "max_requeues"
MIN_SLOWDOWN = "min_slowdown"
NOTIFY = "notify"
RECOVERY = "recovery"
#: The job's own options, as the SPANK plugin names them (``--straggler-max-requeues``...).
OPTIONS = (MAX_REQUEUES, MIN_SLOWDOWN, NOTIFY, RECOVERY)
FIELDS = (POLICY, NODES, USER, ATTEMPT, RUN, REGISTERED_AT, *OPTIONS)


@dataclass(frozen=True)
class Registration:
    """What the prolog registered for a job (all text, as the job's environment gave it)."""

    policy: str = ""
    nodes: str = ""
    user: str = ""
    attempt: str = "0"
    registered_at: str = ""
    #: The run's SLUID (Slurm 25.11 on; "" before).
    run: str = ""
    #: The options the job gave, by name (one of ``OPTIONS``); absent ones are not here.
    options: Mapping[str, str] = field(default_factory=dict)

    def job_options(self) -> JobOptions:
        """The options as the policy applies them."""
        return JobOptions(
            max_requeues=self.options.get(MAX_REQUEUES),
            min_slowdown=self.options.get(MIN_SLOWDOWN),
            notify=self.options.get(NOTIFY),
            recovery=self.options.get(RECOVERY),
        )


def from_fields(fields: Mapping[Any, Any]) -> Registration:
    """A registration from its hash (bytes or text); unknown fields are ignored."""
    found = to_text(fields)
    return Registration(
        policy=found.get(POLICY, ""),
        nodes=found.get(NODES, ""),
        user=found.get(USER, ""),
        attempt=found.get(ATTEMPT, "0"),
        registered_at=found.get(REGISTERED_AT, ""),
        run=found.get(RUN, ""),
        options={k: found[k] for k in OPTIONS if found.get(k)},
    )


def register(client: Any, job_id: str, registration: Registration) -> None:
    """Write (merge) the job's registration, deleting every option it did not give: a
    registration that outlived an older job with this id (a controller reinstalled) must not
    lend it its options."""
    key = keys.job_meta(job_id)
    given = {k: v for k, v in registration.options.items() if k in OPTIONS and v}
    unset = [k for k in OPTIONS if k not in given]
    pipe = client.pipeline(transaction=False)
    if unset:
        pipe.hdel(key, *unset)
    pipe.hset(
        key,
        mapping={
            POLICY: registration.policy,
            NODES: registration.nodes,
            USER: registration.user,
            ATTEMPT: registration.attempt,
            RUN: registration.run,
            REGISTERED_AT: registration.registered_at,
            **given,
        },
    )
    pipe.expire(key, keys.JOB_TTL_ACTIVE_S)
    pipe.execute()


def read(client: Any, job_id: str) -> Registration:
    """The job's registration (empty when unknown)."""
    return from_fields(cast("Mapping[Any, Any]", client.hgetall(keys.job_meta(job_id))))


def read_many(client: Any, job_ids: Sequence[str]) -> dict[str, Registration]:
    """:func:`read` of many jobs, in one round trip."""
    pipe = client.pipeline(transaction=False)
    for job_id in job_ids:
        pipe.hgetall(keys.job_meta(job_id))
    return {j: from_fields(f) for j, f in zip(job_ids, pipe.execute(), strict=True)}


__all__ = ["FIELDS", "OPTIONS", "Registration", "from_fields", "read", "read_many", "register"]
