"""The in-job side: the StepReporter and its instruments (torch, FSDP, Lightning, Hugging
Face, code-free), the node relay and sidecar.

Submodules are imported where needed. What they write to Redis goes through
:mod:`slurm_plugin.store`; the key schema and the record encodings are pure and live in
:mod:`slurm_plugin.model` (``keys``, ``records``, ``columns``, ``relayed``).
"""
