#!/bin/sh
# Slurm Epilog wrapper of slurm-straggler (slurm.conf: Epilog=/path/to/straggler-epilog.sh).
# Exit 1 only for hardware found broken after the job (new uncorrectable ECC errors, critical
# XIDs); telemetry or Redis problems and timeouts exit 0.
bin="${STRAGGLER_EPILOG_BIN:-straggler-epilog}"
limit="${STRAGGLER_EPILOG_TIMEOUT:-25}"
timeout -k 2 "$limit" "$bin"
rc=$?
case "$rc" in
  0|1) exit "$rc" ;;
  *) echo "straggler-epilog: exited $rc (our problem), passing" >&2; exit 0 ;;
esac
