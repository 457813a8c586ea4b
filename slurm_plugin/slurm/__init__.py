"""Slurm adapter: command runner, parsers and scheduler backends."""
