"""The Redis adapter and the records the prolog, the epilog, the ranks and the service
exchange through it: the telemetry store (:mod:`.telemetry_store`) and its Sentinel
connection (:mod:`.sentinel`), per-job credentials (:mod:`.credentials`), a node's hash
(:mod:`.nodes`) and a job's registration (:mod:`.registration`).

Submodules are imported where needed, and all of them need redis. The key schema and the
record encodings they use are pure and live in :mod:`slurm_plugin.model`.
"""
