# The two commands: `make run` and `make test`. Both bootstrap .venv from the pinned requirements.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
DEB_PACKAGES := libsystemd-dev pkg-config iproute2 gcc python3-dev python3-venv lintian rpm systemd openssl \
	slurmctld slurmd slurm-client munge debootstrap prometheus man-db curl jq

.PHONY: run test lint proto man bench deps clean deb rpm k8s-e2e

# Debian packages robustd's build and tests need; installed only when run as root and missing.
deps:
	@if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  missing=$$(for p in $(DEB_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done); \
	  if [ -n "$$missing" ]; then \
	    echo "installing Debian packages: $$missing"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null; \
	  fi; \
	fi

$(STAMP): requirements.txt requirements-dev.txt requirements-analysis.txt pyproject.toml | deps
	@test -x $(PY) || { echo "[1/3] creating $(VENV)"; $(PYTHON) -m venv $(VENV); }
	@echo "[2/3] installing the pinned requirements into $(VENV) (the first time takes minutes: torch is large)"
	$(PY) -m pip install --disable-pip-version-check --progress-bar off -r requirements-dev.txt
	@echo "[3/3] installing robustd itself (editable)"
	$(PY) -m pip install -q --disable-pip-version-check --no-deps -e .
	@touch $(STAMP)

# With an NVIDIA driver the dev config reads the real GPUs; without one, an emulated 8-GPU node.
HAVE_DRIVER := $(wildcard /proc/driver/nvidia/version)
DEV_CONFIG ?= $(if $(HAVE_DRIVER),etc/robustd.dev.yaml,etc/robustd.dev-emulated.yaml)

run: $(STAMP)
	@mkdir -p run var
	@if [ "$(DEV_CONFIG)" = etc/robustd.dev-emulated.yaml ] && [ ! -f var/nvml.state ]; then \
	  echo "no NVIDIA driver: emulating an 8-GPU node in var/nvml.state"; \
	  $(VENV)/bin/robustctl sim --state var/nvml.state init --gpus 8; fi
	@echo "robustd with $(DEV_CONFIG): socket ./run/robustd.sock, state ./var/, metrics http://127.0.0.1:9400/metrics"
	@echo "In another shell:  export ROBUSTD_SOCKET=$$PWD/run/robustd.sock; $(VENV)/bin/robustctl status"
	@echo "Inject a fault:    echo 'NVRM: Xid (PCI:0000:1b:00): 79, pid=1, name=python, GPU has fallen off the bus.' > /dev/kmsg   (as root)"
	@echo "   as a user:      echo '...' | sudo tee /dev/kmsg   (Debian as root has no sudo)"
	@if [ -z "$(HAVE_DRIVER)" ]; then echo "Emulated GPUs:     $(VENV)/bin/robustctl sim --state var/nvml.state fault gpu 3 ecc-dbe"; fi
	exec $(VENV)/bin/robustd --config $(DEV_CONFIG)

test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/pytest -q

lint: $(STAMP)
	$(VENV)/bin/ruff check .

proto: $(STAMP)
	PYTHON=$(PY) scripts/gen-proto.sh

# Man pages (man/) and shell completion (packaging/completion/) from the argument parsers; committed.
man: $(STAMP)
	$(PY) scripts/gen-man.py

BENCHES = detect_kmsg rules detect_hw overhead api_load diag fleet fleet_diagnose stragglers shutdown slurm k8s recorder

bench: $(STAMP)
	set -e; for b in $(BENCHES); do $(PY) bench/$$b.py; done

# robustd-k8s's scenarios (tests/test_k8s.py) against a real cluster instead of the API-server stand-in: the
# cluster in $$KUBECONFIG (e.g. `kind create cluster`), on its first node, as root. Not part of `make test`.
k8s-e2e: $(STAMP)
	@test -n "$$KUBECONFIG" || { echo "k8s-e2e: set KUBECONFIG to a cluster you may write node status to" >&2; exit 2; }
	ROBUSTD_K8S_E2E=1 $(VENV)/bin/pytest -q -m "not standin" tests/test_k8s.py

# Packages (packaging/build.sh; README "Install"). PKG_DIR: where they go. ROBUSTD_VERSION overrides the version.
PKG_DIR ?= dist

deb: $(STAMP)
	packaging/build.sh deb $(PKG_DIR)

rpm: $(STAMP)
	packaging/build.sh rpm $(PKG_DIR)

clean:
	rm -rf $(VENV) run var build dist *.egg-info
