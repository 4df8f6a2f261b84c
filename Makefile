# The two commands a newcomer needs: `make demo` (the main job) and `make test`.
PYTHON ?= python3.11
VENV   ?= .venv
BIN    := $(VENV)/bin
PROTOS := $(wildcard proto/duplex/v1/*.proto)
PROTOC  = PATH="$(abspath $(BIN)):$$PATH" $(BIN)/python -m grpc_tools.protoc -Iproto \
          --python_out=$(1) --grpc_python_out=$(1) --mypy_out=$(1) --mypy_grpc_out=$(1)

.PHONY: setup proto proto-check test fuzz lint bench demo up clean

setup: $(VENV)/.installed

# Everything: the client and session service (base), the worker's models ([worker]) and
# the tools ([dev]). torch==2.13.0 first: it is the CPU build on disk here; the [worker]
# extra's requirement is a range it satisfies, so pip adds no multi-GB CUDA build (a plain
# torch requirement with no torch installed would pull one).
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[worker,dev]'
	touch $@

# Regenerate the committed protobuf code (messages, stubs, .pyi types).
proto: setup
	$(call PROTOC,.) $(PROTOS)

# Fails when the committed generated code differs from what `make proto` makes.
proto-check: setup
	rm -rf build/proto-check && mkdir -p build/proto-check
	$(call PROTOC,build/proto-check) $(PROTOS)
	diff -r -x __init__.py -x __pycache__ -x py.typed build/proto-check/duplex/v1 duplex/v1 \
	  || (echo "generated protobuf code is stale: run 'make proto' and commit" && exit 1)

test: setup proto-check
	$(BIN)/python -m pytest -q

# The live fuzz (tests/live_fuzz.py): hostile clients against a real worker and session service
# while a healthy client talks; fails if an invariant breaks. CI runs 30 s (about 45 s in all);
# longer: make fuzz FUZZ_SECONDS=600
FUZZ_SECONDS ?= 30
fuzz: setup
	$(BIN)/python -m tests.live_fuzz --seconds $(FUZZ_SECONDS)

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy duplex session_service worker_service

bench: setup
	$(BIN)/python -m benchmarks.run

demo: setup
	$(BIN)/duplex demo

up: setup
	$(BIN)/duplex up

clean:
	rm -rf build .pytest_cache .mypy_cache .ruff_cache
