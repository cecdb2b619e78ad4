# The README's two commands: `make serve` and `make test`. Both install what they need first.
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: install install-test serve test lint image image-cuda

install:
	bash scripts/install.sh

install-test:
	bash scripts/install.sh --test

serve: install
	$(VENV)/bin/kvserve serve $(ARGS)

test: install-test
	$(PY) -m ruff check .
	$(PY) -m pytest -q -rs $(ARGS)

lint: install-test
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

# The images, with whichever engine this machine has (docker, else podman): see scripts/image.sh.
image:
	bash scripts/image.sh build cpu $(ARGS)

image-cuda:
	bash scripts/image.sh build cuda $(ARGS)
