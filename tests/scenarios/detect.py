"""A generated job through the detector, and its reports read back: what the detection tests
share."""

from __future__ import annotations

from slurm_plugin.detection import DetectionParams, Detector, StragglerEvent
from tests.scenarios.generator import JobSpec, generate


def run(spec: JobSpec, params: DetectionParams | None = None) -> list[object]:
    """Every event the detector raises over the whole generated job."""
    det = Detector(params)
    det.add(spec.job_id, generate(spec))
    return list(det.advance(final=True))


def reports(events: list[object]) -> list[StragglerEvent]:
    """Every straggler report (a node still slow is reported again each re-arm period)."""
    return [e for e in events if isinstance(e, StragglerEvent)]


def first_reports(events: list[object]) -> list[StragglerEvent]:
    """The first report of each slow node (per attempt and cause)."""
    firsts: dict[tuple[int, str, str], StragglerEvent] = {}
    for e in reports(events):
        firsts.setdefault((e.attempt, e.node, e.cause), e)
    return list(firsts.values())
