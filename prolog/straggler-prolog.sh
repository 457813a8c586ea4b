#!/bin/sh
# Slurm Prolog wrapper of slurm-straggler (slurm.conf: Prolog=/path/to/straggler-prolog.sh).
# Runs the checks under a hard timeout below PrologEpilogTimeout. Exit 1 = a hardware finding
# (Slurm drains the node and requeues the job); our own failures, including this timeout,
# exit 0 so a problem of ours never drains a node. See prolog/README.md.
bin="${STRAGGLER_PROLOG_BIN:-straggler-prolog}"
limit="${STRAGGLER_PROLOG_TIMEOUT:-25}"
timeout -k 2 "$limit" "$bin"
rc=$?
case "$rc" in
  0|1) exit "$rc" ;;
  124|137) echo "straggler-prolog: timed out after ${limit}s, passing" >&2; exit 0 ;;
  *) echo "straggler-prolog: exited $rc (our problem), passing" >&2; exit 0 ;;
esac
