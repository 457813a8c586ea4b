# slurm-straggler: the two commands of the README live here (`make test`; `make demo` later).
# Run as root on Debian/Ubuntu: missing system packages are installed with apt-get.

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PYTEST_ARGS ?=
# The torch extra (DDP tests, examples). Pinned so pip takes the CPU wheel where one is on disk.
TORCH_SPEC ?= torch==2.13.0
APT_PACKAGES := slurmctld slurmd slurm-client munge libslurm-dev redis-server gcc make \
                hostname util-linux python3-venv python3-pip openssl slurmdbd mariadb-server
SYSTEM_PROGRAMS := munged slurmctld slurmd scontrol sinfo squeue sbatch scancel redis-server \
                   unshare hostname gcc openssl runuser slurmdbd sacctmgr mariadbd setpriv

# Slurm releases tested for real by `make test-releases` (Debian suite:Slurm series), and what
# runs on each: the tests marked `release` (the scheduler contract, the service's eviction and
# drain, the prolog's drain, SPANK options, the requeue lever) -- what differs per release. The
# host's own series is left out there: `make test` has just run every test on it.
RELEASES ?= bookworm:22.05 trixie:24.11 sid:26.05
RELEASE_TESTS ?= -m release tests/integration/test_scheduler_contract.py \
                 tests/integration/test_cluster_harness.py tests/integration/test_service.py \
                 tests/integration/test_spank.py tests/integration/test_requeue_delay.py
# The host's Slurm series (22.05 on Debian 12), or empty; HOST_SERIES= tests every release.
HOST_SERIES ?= $(shell slurmd -V 2>/dev/null | sed -nE 's/^slurm(-wlm)? ([0-9]+\.[0-9]+).*/\2/p')

.PHONY: install system-packages test-packages test test-unit test-redis test-cluster test-gpu test-releases release demo lint cluster-up cluster-down clean

install: system-packages $(VENV)/.installed

system-packages:
	@missing=""; \
	for p in $(SYSTEM_PROGRAMS); do command -v $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	[ -f /usr/include/slurm/spank.h ] || missing="$$missing libslurm-dev"; \
	$(PYTHON) -c 'import ensurepip, venv' >/dev/null 2>&1 || missing="$$missing python3-venv"; \
	if [ -n "$$missing" ]; then \
	  echo "installing system packages (missing:$$missing)"; \
	  if [ "$$(id -u)" != 0 ]; then echo "error: run as root to install:$$missing" >&2; exit 1; fi; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
	    --no-install-recommends $(APT_PACKAGES); \
	fi
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "error: Python >= 3.11 is required (set PYTHON=...)")'

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade "pip>=25.1"
	$(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e ".[torch,metrics,demo,arrow,nvml,lightning,hf]" --group dev
	touch $@

# Every test tier this machine can run (contrib/test/tiers): the unit and Redis tiers side by
# side while the local cluster comes up, then the cluster tier; the cluster is always brought
# down again, also when tests fail. Prints each tier's time and the slowest tests. Exit status:
# the first failing tier's (pytest's 5, no tests, is a failure). Each tier also runs alone.
test: install test-packages
	@contrib/test/tiers $(BIN) all $(PYTEST_ARGS)

# Pure code and the shipped fakes; needs nothing.
test-unit: install
	@contrib/test/tiers $(BIN) unit $(PYTEST_ARGS)

# The integration tests that need no Slurm (each starts its own redis-server).
test-redis: install test-packages
	@contrib/test/tiers $(BIN) redis $(PYTEST_ARGS)

# The tests that need the dev cluster (brought up, and down after).
test-cluster: install test-packages
	@contrib/test/tiers $(BIN) cluster $(PYTEST_ARGS)

# The checks that need an NVIDIA GPU (tests/gpu/check.py: the real NVML probe, the prolog's
# GPU checks timed, DDP and FSDP2 with CUDA-event timing, the code-free mode), in their own
# venv with a CUDA build of torch; one table at the end. Without a GPU: one line, exit 0.
GPU_VENV ?= .venv-gpu
GPU_TORCH_SPEC ?= torch==2.13.0
test-gpu:
	@if ! nvidia-smi -L >/dev/null 2>&1; then \
	  echo "test-gpu: no NVIDIA GPU on this machine (nvidia-smi finds none); nothing to check"; \
	  exit 0; fi; \
	command -v redis-server >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && apt-get install -y -qq \
	  --no-install-recommends redis-server >/dev/null 2>&1; } || true; \
	set -e; $(PYTHON) -m venv $(GPU_VENV); \
	$(GPU_VENV)/bin/python -m pip install -q --upgrade "pip>=25.1"; \
	$(GPU_VENV)/bin/python -m pip install -q "$(GPU_TORCH_SPEC)"; \
	$(GPU_VENV)/bin/python -m pip install -q -e ".[torch,nvml]" --group dev; \
	timeout 480 $(GPU_VENV)/bin/python -m tests.gpu.check

# The release: wheel and sdist built (dist/), twine-checked, the wheel installed in a clean venv
# (.venv-release) and its console scripts and in-job import run from there.
release: install
	contrib/release/check $(BIN)/python

# What only the tests need: headless Chromium renders the demo report (tests/integration/
# test_report.py); Prometheus (and its promtool) scrapes the service and checks the alert rules
# (tests/integration/test_prometheus.py).
TEST_PACKAGES := chromium prometheus
test-packages:
	@missing=""; \
	for p in chromium prometheus promtool; do command -v $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  echo "installing system packages for the tests (missing:$$missing)"; \
	  if [ "$$(id -u)" != 0 ]; then echo "error: run as root to install:$$missing" >&2; exit 1; fi; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
	    --no-install-recommends $(TEST_PACKAGES); \
	fi

# The same tests on every Slurm release of RELEASES, each in a minimal Debian chroot with its own
# namespaces (contrib/releases/test-release; chroots cached in /var/cache), the releases side by
# side (they wait on Slurm more than they compute); each one's output is shown whole when all are
# done. Leaves the host's cluster, ports and /etc/hosts alone. Fails if any release failed.
test-releases:
	@command -v debootstrap >/dev/null 2>&1 && command -v ip >/dev/null 2>&1 || { \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
	    --no-install-recommends debootstrap debian-archive-keyring iproute2; }
	@logs=$$(mktemp -d); started=$$(date +%s); running=""; failed=""; \
	for r in $(RELEASES); do \
	  if [ "$${r##*:}" = "$(HOST_SERIES)" ]; then \
	    echo "test-releases: Slurm $${r##*:} is this host's; make test ran every test on it"; \
	    continue; fi; \
	  contrib/releases/test-release "$${r%%:*}" "$${r##*:}" -q --durations=5 $(RELEASE_TESTS) \
	    >"$$logs/$${r%%:*}" 2>&1 & \
	  running="$$running $$!:$$r"; \
	done; \
	for job in $$running; do \
	  r=$${job#*:}; wait "$${job%%:*}" || failed="$$failed $$r"; \
	  echo "---------------- Slurm $${r##*:} ($${r%%:*}) ----------------"; cat "$$logs/$${r%%:*}"; \
	done; \
	rm -rf "$$logs"; \
	echo "test-releases: every release in $$(($$(date +%s) - started)) s"; \
	if [ -n "$$failed" ]; then echo "test-releases: failed on$$failed" >&2; exit 1; fi

# The demo: a real DDP job on the local cluster, node3 slowed down for real, detected and the
# job requeued without it; then the same job under `observe` for comparison, and under torch
# elastic with advice first (node3 left inside the allocation, no requeue). Report in
# demo-report/ (report.html, plot.svg, summary.json). The cluster stays up afterwards.
demo: install
	$(BIN)/straggler demo --advice --out demo-report

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

cluster-up: install
	$(BIN)/straggler devcluster up --spank

cluster-down: install
	$(BIN)/straggler devcluster down

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache *.egg-info
