# The two commands a newcomer needs: `make demo` (the main job) and `make test`.
PYTHON ?= python3.11
VENV   ?= .venv
BIN    := $(VENV)/bin
PROTOS := $(wildcard proto/duplex/v1/*.proto)
PROTOC  = PATH="$(abspath $(BIN)):$$PATH" $(BIN)/python -m grpc_tools.protoc -Iproto \
          --python_out=$(1) --grpc_python_out=$(1) --mypy_out=$(1) --mypy_grpc_out=$(1)

.PHONY: setup proto proto-check test fuzz lint bench demo up clean images deploy-check soak

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

# The benchmark suite (8-9 minutes on a 2-core machine): writes BENCHMARKS.md, benchmarks/latest.json
# and benchmarks/plots/ (see BENCHMARKS.md; compared with benchmarks/baseline.json). DEVICE=cuda runs
# the worker and the models on a GPU and records under benchmarks/gpu/ (benchmarks/gpu.sh does that
# on a GPU machine). TORCH_THREADS: intra-op threads of every model and worker.
DEVICE ?= cpu
TORCH_THREADS ?= 1
bench: setup
	$(BIN)/python -m benchmarks.run --device $(DEVICE) --torch-threads $(TORCH_THREADS)

# The fault-and-load run at full size (CI runs it at 16 sessions for 30 s: tests/test_fault_load.py):
# 64 sessions talking for 120 s while a worker is killed, another hung for 5 s, and a session replica
# killed; exits 1 unless every turn is answered and nothing is lost, misrouted or left behind.
SOAK_SESSIONS ?= 64
SOAK_SECONDS ?= 120
soak: setup
	$(BIN)/python -m tests.fault_load --sessions $(SOAK_SESSIONS) --seconds $(SOAK_SECONDS)

demo: setup
	$(BIN)/duplex demo

up: setup
	$(BIN)/duplex up

# The container images (deploy/images/): session, worker-cpu, worker-cuda, built with docker
# (BuildKit) or podman, whichever works here, tagged $(IMAGE_REGISTRY)/NAME:$(IMAGE_TAG). Push
# them, then pin each overlay's images by the digest the registry reports (deploy/README.md).
IMAGE_REGISTRY ?= duplex
IMAGE_TAG ?= $(shell git rev-parse --short=12 HEAD 2>/dev/null || echo dev)
IMAGES ?= session worker-cpu worker-cuda
CONTAINER_ENGINE ?= $(shell for e in docker podman; do \
  command -v $$e >/dev/null 2>&1 && $$e info >/dev/null 2>&1 && { echo $$e; break; }; done)

images:
	@engine="$(CONTAINER_ENGINE)"; \
	if [ -z "$$engine" ]; then \
	  for e in docker podman; do \
	    if command -v $$e >/dev/null 2>&1; then \
	      echo "make images: $$e is installed but cannot build here ('$$e info' fails: no daemon or runtime)" >&2; \
	    else echo "make images: $$e is not installed" >&2; fi; \
	  done; \
	  echo "make images: no working container engine, no image built" >&2; exit 1; \
	fi; \
	for image in $(IMAGES); do \
	  echo "$$engine build -f deploy/images/$$image.Containerfile -t $(IMAGE_REGISTRY)/$$image:$(IMAGE_TAG) ."; \
	  DOCKER_BUILDKIT=1 $$engine build -f deploy/images/$$image.Containerfile \
	    -t $(IMAGE_REGISTRY)/$$image:$(IMAGE_TAG) . || exit 1; \
	done

# Every overlay rendered and validated against Kubernetes 1.30 and 1.32 offline, the settings the
# deployment relies on, the images' Containerfiles, the Prometheus rules (deploy/check.py).
deploy-check: setup
	$(BIN)/python -m deploy.check

clean:
	rm -rf build .pytest_cache .mypy_cache .ruff_cache
