"""Node health: GPU (NVML) and CPU probes, fabric probe, pure checks, prolog/epilog."""
