"""Shared value types: what the core (detection, policy) and the adapters (Redis, Slurm) both
speak. Pure: nothing here imports another part of the package except ``errors``.

``records`` is a rank's step timings and their stream encoding, ``cluster`` Slurm's jobs and
nodes as we read them, ``keys`` the Redis key schema and the names allowed in it.
"""
