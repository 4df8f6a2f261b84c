#!/bin/sh
# The benchmark suite on a GPU machine, in under 8 minutes: a CUDA worker and CUDA models.
#
#   benchmarks/gpu.sh        from anywhere; after `make setup` with a CUDA build of torch
#                            (PYTHON=/path/to/python to use another interpreter)
#
# Records benchmarks/gpu/BENCHMARKS.md, benchmarks/gpu/latest.json and benchmarks/gpu/plots/ (the
# CPU record at the top level is left alone), with:
#   - the parrot step alone at B = 1, 2, 4, ... 1024 (and 2048, 4096, to find where a step no longer
#     fits a 32 ms frame): ms per step (it ends with the VAD output copied to the host, which waits
#     for the GPU) and the largest B within 32 ms, bisected;
#   - the worker's ceiling (benchmarks/worker_ceiling.py, frame clock): one CUDA worker driven
#     directly on its Run stream, with the near-zero null model and with the parrot, at
#     N = 64 ... 4096 sessions: the most real-time sessions per worker process, µs per session-frame;
#   - the moshi model (benchmarks/moshi.py): Kyutai's Moshiko in bf16 when its weights are in the Hugging
#     Face cache, else the real 7B layout with random weights (nothing is fetched): ms per step and
#     sessions per GPU at real time (the most slots whose step fits 80 ms), and as served at 1, 8, 32;
#   - every other section (hop latency, e2e, CPU per tier, capacity, batching gain) against a
#     `duplex worker --device cuda`, with a coarser capacity ramp and shorter windows so that a
#     machine with many cores stays within the time.
# The run has a 440 s budget (--budget-s): each section gets what is left, the capacity ramps stop in
# time (their capacity is then a lower bound, marked so) and the report is always written. A section
# that fails or does not fit is reported as failed (exit non-zero), never as zeros.
set -eu
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
DEVICE=${DEVICE:-cuda}
"$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 'gpu.sh: torch sees no CUDA device')"
command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
start=$(date +%s)
code=0
"$PY" -m benchmarks.run --device "$DEVICE" --torch-threads 1 --budget-s 440 \
  --model-batches 1,2,4,8,16,32,64,128,256,512,1024,2048,4096 \
  --ceiling-steps 64,256,512,1024,2048,4096 --ceiling-parrot-steps 64,256,512,1024,2048,4096 \
  --capacity-steps 16,32,64,128,192,256,384,512 --capacity-seconds 5 \
  --out build/bench-gpu || code=$?
echo "gpu.sh: $(( $(date +%s) - start )) s, exit $code"
exit $code
