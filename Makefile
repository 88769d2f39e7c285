# The two commands a newcomer needs: `make demo` and `make test`. Everything else is optional.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp

.PHONY: demo test bench chaos chaos-short install tools clean lock lint fmt dist image

# A virtualenv with exactly the locked dependencies (hashes checked) and the package, editable;
# redone when pyproject.toml or the lock changes.
$(STAMP): pyproject.toml requirements-test.lock
	@$(PYTHON) -m venv $(VENV) 2>/dev/null || { \
		echo "python3 -m venv failed: installing python3-venv"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv python3-pip >/dev/null; \
		$(PYTHON) -m venv $(VENV); }
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q --require-hashes -r requirements-test.lock
	$(BIN)/pip install -q --no-deps -e .
	@touch $@

install: $(STAMP)

# Re-resolves pyproject.toml's ranges into requirements.lock (the image) and requirements-test.lock
# (make test, demo, bench), with hashes; pins that still fit are kept.
lock: $(STAMP)
	$(BIN)/python tools/lock.py write

# The locks agree with pyproject.toml, ruff finds nothing, the tree is formatted, mypy is clean
# (--strict on the product), the layers hold (import-linter), the generated reference pages agree
# with the code and the docs site builds with no warning. `make test` runs it first.
lint: $(STAMP)
	$(BIN)/python tools/lock.py check
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/lint-imports --no-cache
	$(BIN)/python docs/gen_reference.py --check
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir $(or $(TMPDIR),/tmp)/k8s-dispatch-site

fmt: $(STAMP)
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

# Runs the whole system on embedded defaults: no cluster, no Redis, no PostgreSQL needed.
demo: $(STAMP)
	$(BIN)/k8s-dispatch demo

# The tools the tests need (etcd, kube-apiserver, kube-controller-manager, helm, promtool, kueue, weed from
# their Go modules; checkov in a virtualenv of its own) in ~/.cache/k8s-dispatch/tools; a second
# run finds them and does nothing.
tools:
	bash tools/build.sh etcd kube containerd helm promtool kueue seaweedfs checkov >/dev/null

# The suite mostly waits on clusters and worker processes: its files run side by side on this many
# workers (tests/conftest.py keeps a file, the real node's tests and the chaos runs together).
TEST_WORKERS ?= 2
PYTEST_ARGS ?= -n $(TEST_WORKERS) --durations=25

# Installs what it needs, starts PostgreSQL and Redis if needed, builds the tools, runs the tests.
test: $(STAMP) tools lint
	bash tests/services.sh
	$(BIN)/python -m pytest $(PYTEST_ARGS)

# Quick (about half an hour on 2 cores, both clusters); FULL=1 for the issues' sizes. Writes lab/bench/results.json.
bench: $(STAMP)
	bash tests/services.sh
	$(BIN)/python -m k8s_dispatch.lab.bench $(if $(FULL),--full) $(BENCH_ARGS)

chaos: $(STAMP)
	bash tests/services.sh
	$(BIN)/python -m k8s_dispatch.lab chaos $(CHAOS_ARGS)

# The release files in dist/, at the version setuptools-scm reads from the git tag (vX.Y.Z; between
# tags X.Y.(Z+1).devN+gHASH): the sdist and the wheel, checked by twine (run by uv, not locked: a
# check, not a dependency), and the Helm chart packaged at the same version (tools/release.py).
dist: $(STAMP)
	rm -rf dist
	$(BIN)/uv build --quiet --out-dir dist .
	$(BIN)/uv tool run --quiet --from 'twine==6.2.0' twine check --strict dist/*
	$(BIN)/python tools/release.py chart dist

# The product's OCI image (an OCI layout archive in dist/), assembled by our own code from Debian's
# packages and the locked virtualenv: no Docker, no registry; the same inputs give the same digest.
image: $(STAMP)
	$(BIN)/python tools/image.py build --out dist

clean:
	rm -rf $(VENV) dist *.egg-info .pytest_cache .hypothesis .mypy_cache .ruff_cache
