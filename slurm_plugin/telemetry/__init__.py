"""The Redis adapter and the in-job side: the store, the StepReporter and its instruments
(torch, FSDP, Lightning, Hugging Face, code-free), the node relay and sidecar, per-job
credentials.

Submodules are imported where needed, and all of them need redis. The key schema and the
record encodings they use are pure and live in :mod:`slurm_plugin.model` (``keys``,
``records``, ``columns``, ``relayed``).
"""
