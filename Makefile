# Everyday commands. `make run` and `make test` install what they need first.
PYTHON ?= python3
VENV := .venv
VENV_BQ := .venv-bq
VENV_CHECKOV := .venv-checkov
PY := $(VENV)/bin/python

.PHONY: analytics install run up down test test-fast lint format bench clean system-deps

install: system-deps $(VENV)/.installed $(VENV_BQ)/.installed

# Redis comes from Debian; the Pub/Sub emulator (Cloud SDK) and Java are expected on the machine.
system-deps:
	@command -v redis-server >/dev/null || { \
	  echo "Installing redis-server from Debian"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null; }
	@command -v java >/dev/null || { echo "Java is required by the Pub/Sub emulator" >&2; exit 1; }
	@command -v gcloud >/dev/null || { echo "The Google Cloud SDK (Pub/Sub emulator) is required" >&2; exit 1; }

$(VENV)/.installed: requirements.txt requirements-worker.txt requirements-dev.txt
	test -d $(VENV) || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --disable-pip-version-check -r requirements-dev.txt
	touch $@

$(VENV_BQ)/.installed: requirements-bq.txt
	test -d $(VENV_BQ) || $(PYTHON) -m venv $(VENV_BQ)
	$(VENV_BQ)/bin/pip install -q --disable-pip-version-check -r requirements-bq.txt
	touch $@

$(VENV_CHECKOV)/.installed: requirements-checkov.txt
	test -d $(VENV_CHECKOV) || $(PYTHON) -m venv $(VENV_CHECKOV)
	$(VENV_CHECKOV)/bin/pip install -q --disable-pip-version-check -r requirements-checkov.txt
	touch $@

run: install
	$(PY) -m emulators.stack run

up: install
	$(PY) -m emulators.stack up

down:
	@test -x $(PY) && $(PY) -m emulators.stack down || true

# The infrastructure tests run checkov from its own virtualenv.
test: install $(VENV_CHECKOV)/.installed
	$(VENV)/bin/pytest

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: $(VENV)/.installed
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

# A bounded benchmark suite on its own stack (port offset 40000); QUICK=1 runs a ~2-minute subset.
bench: install
	$(PY) -m bench.suite $(if $(QUICK),--quick,)

# The analytics views from the local stack's BigQuery emulator: make analytics [SINCE=7d] [MODEL=name]
analytics: $(VENV)/.installed
	$(PY) -m analytics --stack .stack --since $(or $(SINCE),7d) $(if $(MODEL),--model $(MODEL),)

clean:
	rm -rf .stack .pytest_cache .ruff_cache
