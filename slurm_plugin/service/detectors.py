"""Which detector holds each job: one per policy and detection parameters, so that a job's own
stricter minimum (sbatch --straggler-min-slowdown) never changes the thresholds of others."""

from __future__ import annotations

from collections.abc import Callable, ValuesView

import structlog

from slurm_plugin.detection import DetectionParams, Detector
from slurm_plugin.model.cluster import JobInfo
from slurm_plugin.policy.history import slow_elsewhere
from slurm_plugin.policy.rails import PersistencePolicy
from slurm_plugin.policy.schema import Policy
from slurm_plugin.service.identity import Identities
from slurm_plugin.service.state import ServiceState

log = structlog.get_logger(__name__)

#: A detector is kept per (policy name, detection parameters).
Key = tuple[str, DetectionParams]


class Detectors:
    """The service's detectors and the jobs they hold."""

    def __init__(
        self,
        new: Callable[[DetectionParams], Detector],
        state: ServiceState,
        identities: Identities,
        persistence: PersistencePolicy,
        clock: Callable[[], float],
    ) -> None:
        #: Builds a detector for a policy's parameters (a test's scripted detections).
        self._new = new
        self._state = state
        self._identities = identities
        self._persistence = persistence
        self._clock = clock
        #: Per detection policy object (by id, the object kept: an id is never reused while
        #: it is here), its parameters.
        self._params: dict[int, tuple[object, DetectionParams]] = {}
        self._detectors: dict[Key, Detector] = {}
        self._job: dict[str, Key] = {}
        #: Per job, the detector and attempt its nodes slow elsewhere were told for.
        self._told: dict[str, tuple[Key, int]] = {}

    def all(self) -> ValuesView[Detector]:
        """Every detector, each once (a view: no copy for each job of a cycle)."""
        return self._detectors.values()

    def jobs(self) -> list[str]:
        """The jobs a detector holds."""
        return list(self._job)

    def of(self, job_id: str) -> Detector | None:
        """The detector that holds ``job_id``, if one does."""
        key = self._job.get(job_id)
        return None if key is None else self._detectors.get(key)

    def forget(self, job_id: str) -> None:
        """``job_id`` stopped running (or is another job now): its detector drops it."""
        key = self._job.pop(job_id, None)
        if key is not None:
            self._detectors[key].forget(job_id)
        self._told.pop(job_id, None)

    def for_job(self, job: JobInfo, policy: Policy) -> Detector:
        """The detector for ``job`` under ``policy`` (moved to it from another if the job's
        policy changed); a job new to it, or on other nodes after a requeue, is told which of
        its nodes other jobs saw slow lately."""
        key = (policy.name, self._params_of(policy))
        was = self._job.get(job.job_id)
        if was is None or was[0] != policy.name:  # shown by `jobs`, `job show`
            self._state.update_job(job.job_id, policy=policy.name)
        if was is not None and was != key:
            self._detectors[was].forget(job.job_id)
        self._job[job.job_id] = key
        if key not in self._detectors:
            self._detectors[key] = self._new(key[1])
        detector = self._detectors[key]
        if self._told.get(job.job_id) != (key, job.restarts):
            self._told[job.job_id] = (key, job.restarts)
            params = self._persistence.params()
            token, now = self._identities.token(job), self._clock()
            found = slow_elsewhere(self._state.node_histories(job.nodes), token, now, params)
            detector.suspect(job.job_id, found)
            if found:
                log.info("service.nodes_slow_elsewhere", job_id=job.job_id, nodes=found[:16])
        return detector

    def _params_of(self, policy: Policy) -> DetectionParams:
        """The policy's detection parameters, worked out once per policy object (each cycle
        re-reads the policies; the jobs of one policy share its object): was ~10 us a job."""
        kept = self._params.get(id(policy.detection))
        if kept is None or kept[0] is not policy.detection:
            if len(self._params) > 256:
                self._params.clear()
            kept = self._params[id(policy.detection)] = (
                policy.detection,
                policy.detection.params(),
            )
        return kept[1]
