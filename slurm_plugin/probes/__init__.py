"""Hardware probes shared by the prolog's checks and the node sidecar: GPUs through NVML (and
the fake NVML that stands in for it where no GPU exists), CPUs from procfs and sysfs."""
