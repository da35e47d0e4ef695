#!/usr/bin/env bash
# The H200 serving runs of benchmarks/results/h200/serving/README.md, one phase per device call.
#   bash benchmarks/gpu/h200_serving.sh PHASE OUT_DIR
# PHASE: setup | cuda-tests | load RATES [DURATION_S] | smollm2 MODEL | faults DURATION_S [SERVE_FLAGS] | gaps [REQUESTS [HOST_CACHE_BLOCKS [OFFLOAD_AHEAD_BLOCKS]]]
#        | phase-b [REQUESTS [OFFLOAD_AHEAD_BLOCKS [HOST_CACHE_BLOCKS]]] | faults-bg DURATION_S | faults-wait | profile-gaps [REQUESTS]
#        | speculative-smollm2 | speculative-nemo | replay-drafts-beams [REQUESTS]
# faults-bg starts the fault soak detached (in /tmp/faults) so that a soak longer than one device call
# (600 s) spans two: the next call's faults-wait waits for it and copies its results to OUT_DIR.
# The H200 image lacks fastapi, uvicorn, openai and gguf: setup installs the wheels in .whl
# (fetched here, beside the checkout's .venv, by fetch_wheels.sh) into /tmp/site.
set -uo pipefail
PY=${PY:-python3}
phase=$1; out=$2; shift 2
here=$(cd "$(dirname "$0")/../.." && pwd)
cd "$here"
export PYTHONPATH="$here:/tmp/site" PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
mkdir -p "$out"
MODEL=${MODEL:-mistral-nemo-12b-random}
NEMO=("$MODEL" --extra_llm_api_options benchmarks/gpu/nemo.yaml --max_queue_size 128)

case $phase in
  setup)
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    python3 -c "import fastapi, uvicorn, openai, gguf, torch; print('torch', torch.__version__, torch.cuda.get_device_name())"
    ;;
  cuda-tests)
    timeout 400 "$PY" -m pytest tests/unittest/_torch/attention/test_cuda.py tests/unittest/serve/test_serve_gpu.py \
      tests/unittest/_torch/speculative/test_speculative_cuda.py tests/unittest/_torch/pyexecutor/sampling/test_beam_search_cuda.py \
      -q -rs -p no:cacheprovider --durations=5 > "$out/pytest_cuda.log" 2>&1
    tail -15 "$out/pytest_cuda.log"
    ;;
  load)
    "$PY" -m benchmarks.serving.soak --out "$out" --rates "$1" --duration-s "${2:-180}" -- "${NEMO[@]}"
    ;;
  smollm2)
    "$PY" -m benchmarks.gpu.smollm2 --out "$out" --model "$1"
    ;;
  faults)  # faults DURATION_S [more trtllm-serve flags]
    duration=$1; shift
    "$PY" -m benchmarks.serving.soak --out "$out" --rates 1 --duration-s "$duration" --health-interval-s 0.5 -- \
      "$MODEL" --extra_llm_api_options benchmarks/gpu/nemo_faults.yaml --max_queue_size 128 "$@"
    ;;
  faults-bg)  # faults-bg DURATION_S [more trtllm-serve flags]: detached, results in /tmp/faults
    mkdir -p /tmp/faults
    setsid nohup bash "$0" faults /tmp/faults "$@" > /tmp/faults/soak.log 2>&1 < /dev/null &
    echo "fault soak started detached, pid $!"
    ;;
  faults-wait)
    while pgrep -f "h200_serving.sh faults /tmp/faults" > /dev/null; do sleep 5; done
    cp -r /tmp/faults/. "$out"/ && tail -20 "$out/soak.log"
    ;;
  phase-b)  # phase-b [REQUESTS [OFFLOAD_AHEAD_BLOCKS [HOST_CACHE_BLOCKS]]]: the recheck replay with and without
            # overlap: GPU idle, largest gaps, the refit cost model
    "$PY" -m benchmarks.gpu.phase_b --out "$out" --sections replay --policies recheck --requests "${1:-150}" \
      --offload-ahead-blocks "${2:-0}" --host-cache-blocks "${3:-512}" 2>&1 | tail -40
    ;;
  gaps)  # gaps [REQUESTS [HOST_CACHE_BLOCKS [OFFLOAD_AHEAD_BLOCKS]]]
    "$PY" -m benchmarks.gpu.gaps --requests "${1:-150}" --policy recheck --top 10 --host-cache-blocks "${2:-512}" \
      --offload-ahead-blocks "${3:-0}" --json "$out/gaps.json" 2>&1 | tail -30
    ;;
  profile-gaps)  # gaps under cProfile: where the host's time goes in the KV allocation and the launch
    timeout 300 "$PY" -m cProfile -o "$out/gaps.prof" -m benchmarks.gpu.gaps --requests "${1:-150}" --top 5 > "$out/gaps.txt" 2>&1
    "$PY" - "$out/gaps.prof" > "$out/profile.txt" 2>&1 <<'PY'
import pstats, sys
stats = pstats.Stats(sys.argv[1])
stats.sort_stats("tottime").print_stats(30)
for name in ("kv_cache_manager.py.*prepare_resources", "_issue_batch", "_evict_until", "forward_async"):
    stats.sort_stats("cumulative").print_callees(name)
PY
    tail -5 "$out/gaps.txt"; head -70 "$out/profile.txt"
    ;;
  speculative-smollm2)  # NGram drafts against none on SmolLM2 (a real acceptance rate), bf16
    for b in 1 4 8; do
      "$PY" -m benchmarks.model.speculative --model "${SMOLLM2:-smollm2-135m-instruct}" --device cuda --dtype bfloat16 \
        --workloads repetitive --batch $b --max-tokens 256 --repeats 5 --json "$out/h200_smollm2_repetitive_b$b.json"
    done
    "$PY" -m benchmarks.model.speculative --model "${SMOLLM2:-smollm2-135m-instruct}" --device cuda --dtype bfloat16 --workloads default \
      --num-requests 64 --max-prompt-len 4096 --max-num-tokens 8192 --max-tokens 256 --repeats 3 \
      --json "$out/h200_smollm2_default.json"
    ;;
  speculative-nemo)  # random weights: acceptance near 0, so this measures what speculating costs when it does not pay
    for b in 1 8; do
      "$PY" -m benchmarks.model.speculative --model "$MODEL" --device cuda --workloads repetitive,default --batch $b \
        --max-tokens 128 --num-requests 32 --max-prompt-len 4096 --max-num-tokens 8192 --repeats 3 \
        --json "$out/h200_nemo_b$b.json"
    done
    ;;
  replay-drafts-beams)  # the five policies on the real engine with drafts (first drafts) and beams on
    "$PY" -m benchmarks.replay --engine torch --device cuda --model "$MODEL" --num-requests "${1:-150}" \
      --speculative-config.max-draft-len 4 --beam-every 4 --beam-width 4 --json "$out/h200_replay_drafts4_beams4.json" 2>&1 | tail -25
    ;;
  *) echo "unknown phase $phase"; exit 2 ;;
esac
