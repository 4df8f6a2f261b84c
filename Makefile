# The two commands a newcomer needs: `make demo` (the main job) and `make test`.
PYTHON ?= python3.11
VENV   ?= .venv
BIN    := $(VENV)/bin
PROTOS := $(wildcard proto/duplex/v1/*.proto)
PROTOC  = PATH="$(abspath $(BIN)):$$PATH" $(BIN)/python -m grpc_tools.protoc -Iproto \
          --python_out=$(1) --grpc_python_out=$(1) --mypy_out=$(1) --mypy_grpc_out=$(1)

.PHONY: setup proto proto-check test fuzz lint bench demo up clean images images-check deploy-check soak

setup: $(VENV)/.installed

# Kyutai's moshi (the moshi model): its metadata pins an older torch and numpy than it runs on,
# so it goes in without its dependencies, after its real needs (the worker extra lists them).
MOSHI_VERSION ?= 0.2.13

# Everything: the client and session service (base), the worker's models ([worker]), WebRTC on
# the Realtime edge ([webrtc]), the tools ([dev]) and the voice-agent frameworks the Realtime
# edge's tests drive ([frameworks], then Pipecat with --no-deps: its pins clash with this
# project's, see pyproject.toml; about 40 s more). torch==2.13.0 first: it is the CPU build on
# disk here; the [worker] extra's requirement is a range it satisfies, so pip adds no multi-GB
# CUDA build (a plain torch requirement with no torch installed would pull one).
PIPECAT ?= pipecat-ai==1.14.0
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[worker,webrtc,dev,frameworks]'
	$(BIN)/pip install -q --no-deps moshi==$(MOSHI_VERSION)
	$(BIN)/pip install -q --no-deps '$(PIPECAT)'
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
	$(BIN)/python -m pytest -q --durations=15

# The live fuzz (tests/live_fuzz.py): hostile clients against a real worker and session service
# while a healthy client talks; fails if an invariant breaks. CI runs 30 s (about 45 s in all);
# longer: make fuzz FUZZ_SECONDS=600
FUZZ_SECONDS ?= 30
fuzz: setup
	$(BIN)/python -m tests.live_fuzz --seconds $(FUZZ_SECONDS)

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy duplex session_service worker_service realtime_service

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
	$(BIN)/duplex demo --pipeline cascade

up: setup
	$(BIN)/duplex up

# The container images (deploy/images/): session, worker-cpu, worker-cuda, built with docker
# (BuildKit), podman or buildah (--isolation chroot unless BUILDAH_ISOLATION says otherwise),
# the first that works here, tagged $(IMAGE_REGISTRY)/NAME:$(IMAGE_TAG), with the version and
# commit as OCI labels. An image whose base cannot be pulled is skipped with the reason, the others
# are built; it exits 1 if any was not. IMAGE_BUILD_ARGS: more build options, e.g.
# --build-arg PYTHON_IMAGE=... (the base). Push them, then pin each overlay's images by the digest
# the registry reports (deploy/README.md).
IMAGE_REGISTRY ?= duplex
IMAGE_TAG ?= $(shell git rev-parse --short=12 HEAD 2>/dev/null || echo dev)
IMAGE_VERSION ?= $(shell sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml | head -n 1)
IMAGE_REVISION ?= $(shell git rev-parse HEAD 2>/dev/null || echo unknown)
IMAGE_BUILD_ARGS ?=
IMAGES ?= session realtime worker-cpu worker-cuda
CONTAINER_ENGINE ?= $(shell for e in docker podman buildah; do \
  command -v $$e >/dev/null 2>&1 && $$e info >/dev/null 2>&1 && { echo $$e; break; }; done)

images:
	@engine="$(CONTAINER_ENGINE)"; \
	if [ -z "$$engine" ]; then \
	  for e in docker podman buildah; do \
	    if command -v $$e >/dev/null 2>&1; then \
	      echo "make images: $$e is installed but cannot build here ('$$e info' fails: no daemon or runtime)" >&2; \
	    else echo "make images: $$e is not installed" >&2; fi; \
	  done; \
	  echo "make images: no working container engine, no image built" >&2; exit 1; \
	fi; \
	case "$$engine" in \
	  buildah) build="buildah bud --isolation $${BUILDAH_ISOLATION:-chroot}"; has="buildah inspect --type image";; \
	  *) build="$$engine build"; has="$$engine image inspect";; \
	esac; \
	echo "make images: building with $$engine ($$(command -v $$engine))"; \
	built=""; missed=""; \
	for image in $(IMAGES); do \
	  file=deploy/images/$$image.Containerfile; \
	  arg=$$(sed -n 's/^ARG \([A-Z_]*_IMAGE\)=.*/\1/p' $$file | head -n 1); \
	  base=$$(echo " $(IMAGE_BUILD_ARGS) " | sed -n "s/.*[ =]$$arg=\([^ ]*\) .*/\1/p"); \
	  base=$${base:-$$(sed -n "s/^ARG $$arg=//p" $$file | head -n 1)}; \
	  if ! $$has $$base >/dev/null 2>&1 && ! why=$$($$engine pull -q $$base 2>&1 >/dev/null); then \
	    why=$$(printf '%s\n' "$$why" | tail -n 1); \
	    echo "make images: $$image NOT built: its base $$base cannot be pulled: $$why" >&2; \
	    missed="$$missed $$image"; continue; \
	  fi; \
	  echo "$$build -f $$file -t $(IMAGE_REGISTRY)/$$image:$(IMAGE_TAG) ."; \
	  if DOCKER_BUILDKIT=1 $$build -f $$file -t $(IMAGE_REGISTRY)/$$image:$(IMAGE_TAG) \
	      --build-arg VERSION=$(IMAGE_VERSION) --build-arg REVISION=$(IMAGE_REVISION) $(IMAGE_BUILD_ARGS) .; \
	  then built="$$built $$image"; \
	  else echo "make images: $$image NOT built: $$build failed (above)" >&2; missed="$$missed $$image"; fi; \
	done; \
	echo "make images ($$engine): built:$${built:- none}; not built:$${missed:- none}"; \
	[ -z "$$missed" ]

# Builds the session and CPU worker images with buildah (from a debootstrap Debian base when no
# registry answers), runs them as a local stack on loopback, holds a conversation through them
# with duplex talk, checks sizes, labels, user and no torch in the session image, then removes
# everything it made (deploy/image_check.py; about 2.5 minutes on 2 cores, 3.5 without the cached
# base in build/image-check/). Needs root, buildah and debootstrap (it apt-get installs them).
images-check: setup
	$(BIN)/python -m deploy.image_check

# Every overlay rendered and validated against Kubernetes 1.30 and 1.32 offline, the settings the
# deployment relies on, the images' Containerfiles, the Prometheus rules (deploy/check.py).
deploy-check: setup
	$(BIN)/python -m deploy.check

clean:
	rm -rf build .pytest_cache .mypy_cache .ruff_cache
