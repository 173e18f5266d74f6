# Everyday commands. `make run` and `make test` install what they need first.
PYTHON ?= python3
VENV := .venv
# The test files run on three processes (pytest-xdist): two with a stack each, for the stack tests first, and one for
# the files that need none, on the CPU the waiting stack tests leave (tests/file_order.py: longest files first).
# `make test PYTEST_PARALLEL=` runs them all on one.
PYTEST_PARALLEL ?= -n 3 --dist loadfile --no-loadscope-reorder
VENV_BQ := .venv-bq
VENV_CHECKOV := .venv-checkov
PY := $(VENV)/bin/python
# One install step: says what it does, runs it, says how long it took. $(call step,what,command)
step = @printf '==> %s\n' "$(1)"; started=$$(date +%s); $(2) && printf '    done in %ss (%s)\n' $$(( $$(date +%s) - started )) "$@"

.PHONY: analytics capacity chaos gpu-check import-model install run up down test test-durations test-fast lint format bench clean system-deps

.PHONY: status restart bootstrap browser-deps docs docs-serve

# The virtualenvs install side by side (pip is much of the time unpacking and writing files): `make test` from a
# bare clone about 25 s sooner on two cores. The Debian packages come first, one apt-get at a time.
install: system-deps
	@$(MAKE) --no-print-directory --silent -j2 $(VENV)/.installed $(VENV_BQ)/.installed

# Redis comes from Debian; the Pub/Sub emulator (Cloud SDK) and Java are expected on the machine.
system-deps:
	@command -v redis-server >/dev/null || { \
	  echo "==> Installing redis-server from Debian"; started=$$(date +%s); \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null && \
	  echo "    done in $$(( $$(date +%s) - started ))s"; }
	@command -v java >/dev/null || { echo "Java is required by the Pub/Sub emulator" >&2; exit 1; }
	@command -v gcloud >/dev/null || { echo "The Google Cloud SDK (Pub/Sub emulator) is required" >&2; exit 1; }

$(VENV)/.installed: requirements.txt requirements-worker.txt requirements-dev.txt requirements-docs.txt maas_client/pyproject.toml
	$(call step,Creating the virtualenv $(VENV),test -d $(VENV) || $(PYTHON) -m venv $(VENV))
	$(call step,Installing requirements-dev.txt into $(VENV) (torch CPU and diffusers: about two minutes the first time),$(VENV)/bin/pip install -q --disable-pip-version-check -r requirements-dev.txt)
	@touch $@

$(VENV_BQ)/.installed: requirements-bq.txt
	$(call step,Creating the virtualenv $(VENV_BQ) (the BigQuery emulator),test -d $(VENV_BQ) || $(PYTHON) -m venv $(VENV_BQ))
	$(call step,Installing requirements-bq.txt into $(VENV_BQ),$(VENV_BQ)/bin/pip install -q --disable-pip-version-check -r requirements-bq.txt)
	@touch $@

$(VENV_CHECKOV)/.installed: requirements-checkov.txt
	$(call step,Creating the virtualenv $(VENV_CHECKOV) (the Terraform scanner),test -d $(VENV_CHECKOV) || $(PYTHON) -m venv $(VENV_CHECKOV))
	$(call step,Installing requirements-checkov.txt into $(VENV_CHECKOV),$(VENV_CHECKOV)/bin/pip install -q --disable-pip-version-check -r requirements-checkov.txt)
	@touch $@

# The stack: `run` in the foreground, `up` in the background (both supervise the API and the workers).
run: install
	@$(PY) -m emulators.stack run

up: install
	@$(PY) -m emulators.stack up

down:
	@if test -x $(PY); then $(PY) -m emulators.stack down; else echo "Nothing is running (no $(VENV) yet)."; fi

# Each component with its pid, port and health. The command exits 1 when one is not healthy, 3 when none runs;
# make turns any failure into its own status 2 (call `.venv/bin/python -m emulators.stack status` to tell them apart).
status: $(VENV)/.installed
	@$(PY) -m emulators.stack status

# Restart one component on purpose: make restart COMPONENT=api, or make restart-api (names: make status).
restart: $(VENV)/.installed
	@test -n "$(COMPONENT)" || { echo "usage: make restart COMPONENT=<name> (see make status)" >&2; exit 2; }
	@$(PY) -m emulators.stack restart $(COMPONENT)

restart-%: $(VENV)/.installed
	@$(PY) -m emulators.stack restart $*

# Re-create whatever is missing (topics, subscriptions, buckets, table, views), e.g. after a Pub/Sub restart.
bootstrap: $(VENV)/.installed
	@$(PY) -m emulators.stack bootstrap

# The browser tests drive Debian's headless Chromium through its chromedriver.
browser-deps:
	@command -v chromedriver >/dev/null || { \
	  echo "==> Installing chromium and chromium-driver from Debian (browser tests)"; started=$$(date +%s); \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null && \
	  echo "    done in $$(( $$(date +%s) - started ))s"; }

# The infrastructure tests run checkov from its own virtualenv.
test: system-deps browser-deps
	@$(MAKE) --no-print-directory --silent -j3 $(VENV)/.installed $(VENV_BQ)/.installed $(VENV_CHECKOV)/.installed
	$(VENV)/bin/pytest $(PYTEST_PARALLEL)

# The whole suite, writing each file's seconds to tests/file_seconds.json (the order the files are handed out in).
test-durations: system-deps browser-deps
	@$(MAKE) --no-print-directory --silent -j3 $(VENV)/.installed $(VENV_BQ)/.installed $(VENV_CHECKOV)/.installed
	$(VENV)/bin/pytest $(PYTEST_PARALLEL) --write-file-seconds tests/file_seconds.json

# The layering contracts ([tool.importlinter] in pyproject.toml) also run in `make test` (tests/unit/test_layering.py).
lint: $(VENV)/.installed
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports --no-logo

format: $(VENV)/.installed
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

# A bounded benchmark suite on its own stack (port offset 12000); QUICK=1 runs a ~2-minute subset.
bench: install
	$(PY) -m bench.suite $(if $(QUICK),--quick,)

# Check a diffusers folder and upload it to the model bucket with its manifest; prints the catalog version to add:
# make import-model SOURCE=path/to/folder-or-file.safetensors MODEL=name VERSION=2 [FAMILY=sdxl] [BASE=dir-or-gs://...]
# [STACK=.stack] (into the local stack's GCS emulator; without it, the bucket the environment's settings name)
import-model: $(VENV)/.installed
	@test -n "$(SOURCE)" -a -n "$(MODEL)" -a -n "$(VERSION)" || { echo "usage: make import-model SOURCE=dir MODEL=name VERSION=v [FAMILY=f] [BASE=b]" >&2; exit 2; }
	$(PY) -m model_worker.weights import "$(SOURCE)" --model "$(MODEL)" --version "$(VERSION)" $(if $(FAMILY),--family $(FAMILY),) $(if $(BASE),--base "$(BASE)",) $(if $(STACK),--stack "$(STACK)",)

# The GPU check (bench/gpu_check.py): one table of PASS/MISS lines on a CUDA GPU, at most 8 minutes from bare
# weights; TINY=1 runs the same code at tiny sizes on a CPU. Where there is no $(VENV) (a GPU node with its own
# torch) it runs on python3; ARGS passes options: make gpu-check ARGS="--lines sd15 flux.bf16 --budget 300"
GPU_CHECK_PYTHON = $(if $(wildcard $(PY)),$(PY),$(PYTHON))
gpu-check:
	$(GPU_CHECK_PYTHON) -m bench.gpu_check $(if $(TINY),--tiny,) $(ARGS)

# How many GPUs a day needs, by simulation (bench/capacity): the seed's day on L4s, both schedulings, two autoscaler
# settings and the seed's 150 GPUs; a few minutes. ARGS passes options: make capacity ARGS="--trace day.csv"
capacity: $(VENV)/.installed
	$(PY) -m bench.capacity $(ARGS)

# Faults and bad inputs against a stack of its own (two workers per model); non-zero exit if anything was lost.
chaos: install
	$(PY) -m chaos $(if $(QUICK),--quick,)

# The analytics views from the local stack's BigQuery emulator: make analytics [SINCE=7d] [MODEL=name]
analytics: $(VENV)/.installed
	$(PY) -m analytics --stack .stack --since $(or $(SINCE),7d) $(if $(MODEL),--model $(MODEL),)

# The documentation site (mkdocs.yml): built offline with --strict into .site/ (a broken link, a page missing from the
# nav or a failing reference generator is an error); docs-serve serves the built site on http://127.0.0.1:8000.
DOCS_PORT ?= 8000
docs: $(VENV)/.installed
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet

docs-serve: docs
	@echo "The documentation: http://127.0.0.1:$(DOCS_PORT)/ (Ctrl-C stops it)"
	@$(PY) -m http.server $(DOCS_PORT) --bind 127.0.0.1 --directory .site

clean:
	rm -rf .stack .pytest_cache .ruff_cache .site
