# The README's two commands: `make serve` and `make test` (the whole suite, as CI runs it). Both install what they
# need first. `make test-fast` is the developer's loop: ruff and the tests not marked slow.
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: install install-test serve test test-fast lint image image-cuda

install:
	bash scripts/install.sh

install-test:
	bash scripts/install.sh --test

serve: install
	$(VENV)/bin/kvserve serve $(ARGS)

test: install-test
	$(PY) -m ruff check .
	$(PY) -m pytest -q -rfEs $(ARGS)

# No real model, browser, container or live replica (tests/conftest.py fails a test that needs one unmarked).
test-fast: install-test
	$(PY) -m ruff check .
	$(PY) -m pytest -q -rfEs -m "not slow" $(ARGS)

lint: install-test
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

# The images, with whichever engine this machine has (docker, else podman): see scripts/image.sh.
image:
	bash scripts/image.sh build cpu $(ARGS)

image-cuda:
	bash scripts/image.sh build cuda $(ARGS)
