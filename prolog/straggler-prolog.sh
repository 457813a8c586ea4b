#!/bin/sh
# Slurm Prolog wrapper of slurm-straggler (slurm.conf: Prolog=/path/to/straggler-prolog.sh).
# Runs the checks under a hard timeout below PrologEpilogTimeout. Exit 1 = a hardware finding
# (Slurm drains the node and requeues the job); our own failures, including this timeout,
# exit 0 so a problem of ours never drains a node. See prolog/README.md.
# What we say also goes to syslog (slurmd discards a passing prolog's output); the socket is
# STRAGGLER_HEALTH_SYSLOG_SOCKET, /dev/log by default.
# The console script: STRAGGLER_PROLOG_BIN, else the one of the venv this wrapper was
# installed into (/opt/slurm-straggler/prolog/ -> /opt/slurm-straggler/bin/), else PATH.
here="$(dirname "$0")"
default=straggler-prolog
[ -x "$here/../bin/straggler-prolog" ] && default="$here/../bin/straggler-prolog"
bin="${STRAGGLER_PROLOG_BIN:-$default}"
limit="${STRAGGLER_PROLOG_TIMEOUT:-25}"
say() {
  echo "straggler-prolog: $1" >&2
  logger -u "${STRAGGLER_HEALTH_SYSLOG_SOCKET:-/dev/log}" -t straggler-prolog -p daemon.err \
    -- "$1" 2>/dev/null || true
}
timeout -k 2 "$limit" "$bin"
rc=$?
case "$rc" in
  0|1) exit "$rc" ;;
  124|137) say "timed out after ${limit}s, passing"; exit 0 ;;
  *) say "exited $rc (our problem), passing"; exit 0 ;;
esac
