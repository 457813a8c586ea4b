"""In-job telemetry: key schema, records, Redis store, the StepReporter and the node sidecar.

Submodules are imported where needed: ``records`` and ``keys`` are pure, ``store``,
``reporter`` and ``sidecar`` need redis.
"""
