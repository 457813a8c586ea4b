"""The policy service: read telemetry, detect, decide, act on Slurm, verify, audit."""
