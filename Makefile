# The two set-up commands of the README: `make run` and `make test`.
# Both create .venv on first use and install the project into it.

PYTHON ?= python3
VENV ?= .venv
# torch 2.13.0 matches the CPU build that vLLM's CPU wheels pin; on a GPU node
# PyPI gives the CUDA build of the same version.
TORCH_SPEC ?= torch==2.13.0
PYTEST_ARGS ?=

STAMP := $(VENV)/.installed

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install --quiet --upgrade pip
	$(VENV)/bin/python -m pip install --quiet "$(TORCH_SPEC)"
	$(VENV)/bin/python -m pip install --quiet -e ".[test]"
	touch $(STAMP)

.PHONY: install run test
install: $(STAMP)

run: $(STAMP)
	$(VENV)/bin/kvdepotd $(ARGS)

test: $(STAMP)
	$(VENV)/bin/python -m pytest $(PYTEST_ARGS)
