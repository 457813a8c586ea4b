"""Pure statistics: find the straggling rank, a hung job or a job-wide sync stall."""

from slurm_plugin.detection.detector import Detector
from slurm_plugin.detection.events import Event, HangEvent, StragglerEvent, SyncStallEvent
from slurm_plugin.detection.params import DetectionParams
from slurm_plugin.model.batch import RecordBatch

__all__ = [
    "DetectionParams",
    "Detector",
    "Event",
    "HangEvent",
    "RecordBatch",
    "StragglerEvent",
    "SyncStallEvent",
]
