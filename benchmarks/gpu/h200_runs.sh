#!/usr/bin/env bash
# The H200 runs of the FP8 KV cache, drafts under CUDA graphs and overlap, and the figures a peer can
# compare (docs/gpu.md says what each measures). One phase per device call, each under 9 minutes;
# everything under OUT_DIR, each phase's files also tarred as OUT_DIR/PHASE.tar.gz (at most 8 files
# come back from a call).
#
#   bash benchmarks/gpu/h200_runs.sh fetch                 # HERE, once: wheels into .whl/, SmolLM2's file
#                                                          # in two parts and its tokenizer into .carry/
#   bash benchmarks/gpu/h200_runs.sh PHASE OUT_DIR [ARGS]  # on the H200
#
# PHASE (device call's carry in brackets; expected duration):
#   cuda-tests            []                                ~5 min   the CUDA tests (FP8, drafts, graphs, beams, attention)
#   stage-smollm2         [.carry/smollm2-a.part]           ~10 s    half of SmolLM2's GGUF to /tmp/stage (the working tree
#                                                                    travels in at most 64 MiB; the file is 94 MiB)
#   speculative           [.carry/gguf .carry/smollm2-b.part] ~6 min right after stage-smollm2 (the machine keeps /tmp for
#                                                                    30 s): benchmarks.model.speculative, SmolLM2, repetitive,
#                                                                    batch 1/4/8 with overlap (the defaults), then 1/8 without;
#                                                                    64 requests of the default scenario with max_concurrency 16
#   fp8-decode            []                                ~4 min   decode 64 x 8k and 256 x 2k, bf16 vs FP8 pools, roofline
#   fp8-replay            []       [REQUESTS]               ~6 min   the default scenario, same pool bytes in bf16 and FP8
#   fp8-roofline          []                                ~7 min   the FP8 decode kernel against bf16 (TB/s, a sweep of shapes),
#                                                                    the two CUDA tests it must pass and the fused-layer ones,
#                                                                    the 8B decode step against its rooflines (bf16 batch 1/16/
#                                                                    64/256 profiled at 1 and 64; FP8 at 64 and 256), the
#                                                                    in-process engine FP8 vs bf16 at c=1/16/64, the unfused
#                                                                    layers at batch 1 and 64 if time is left; a table last
#   peer-bf16, peer-fp8   [.whl .carry/smollm2-tokenizer]   ~8 min   Llama-3.1-8B-shaped checkpoint, trtllm-serve, GuideLLM
#                                                                    1024/128 and 1024/1024 at concurrency 1..128
#   peer-engine           [.whl .carry/smollm2-tokenizer]   ~8 min   the same requests through LLM in-process (no HTTP)
#   hf-checkpoints        [.whl]           [MODEL]          ~8 min   a random bf16 sharded checkpoint written by transformers on
#                                                                    the machine (llama-3.1-8b, or qwen3-8b), served by
#                                                                    trtllm-serve DIR: load time, GPU memory, the default scenario at 1x
#   nccl                  (a 2-GPU host)                             not built: says so and stops
set -uo pipefail
PY=${PY:-python3}
phase=${1:?PHASE}
here=$(cd "$(dirname "$0")/../.." && pwd)
cd "$here"

if [ "$phase" = fetch ]; then  # here, where the package registry is
  set -e
  bash benchmarks/gpu/fetch_wheels.sh > /dev/null
  extra=(guidellm==0.8.1 culsans aiologic datasets dill multiprocess eval_type_backport faker ftfy wcwidth loguru
         pydantic-settings python-dotenv sanic sanic-routing httptools ujson html5tagger tracerite websockets
         more-itertools h2 hpack hyperframe typing-extensions==4.16.0 click==8.4.2)
  tmp=$(mktemp -d)
  platforms=()
  for tag in manylinux_2_39 manylinux_2_35 manylinux_2_34 manylinux_2_31 manylinux_2_28 manylinux_2_17 manylinux2014 manylinux1; do
    platforms+=(--platform "${tag}_x86_64")
  done
  .venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" -d "$tmp" "${extra[@]}"
  for wheel in "$tmp"/*.whl; do  # one version of each project: the checkout's where fetch_wheels has it
    project=$(basename "$wheel" | cut -d- -f1 | tr 'A-Z-' 'a-z_')
    ls .whl | cut -d- -f1 | tr 'A-Z-' 'a-z_' | grep -qx "$project" || cp "$wheel" .whl/
  done
  rm -rf "$tmp"
  grep -qx '/.carry/' .git/info/exclude 2>/dev/null || echo /.carry/ >> .git/info/exclude
  mkdir -p .carry
  gguf=$(.venv/bin/python -c "from tensorrt_llm._torch.models.checkpoints import packaged_checkpoint_path as p; print(p('smollm2-135m-instruct'))")
  half=$(( $(stat -c %s "$gguf") / 2 + 1 ))
  head -c "$half" "$gguf" > .carry/smollm2-a.part
  tail -c +$((half + 1)) "$gguf" > .carry/smollm2-b.part
  .venv/bin/python -m tools.gguf_to_hf --out .carry/smollm2-tokenizer --tokenizer-only
  mkdir -p .carry/gguf && cp .whl/gguf-*.whl .carry/gguf/  # all the speculative phase needs (its call carries 47 MB of GGUF)
  du -sh .whl .carry/*
  exit 0
fi

out=${2:?OUT_DIR}
shift 2
mkdir -p "$out"
export PYTHONPATH="$here:/tmp/site" PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

setup() {  # setup DIR: the wheels the image lacks (carried in DIR), once per machine
  [ -f "/tmp/site/.installed-$(basename "$1")" ] && return 0
  ls "$1"/*.whl > /dev/null 2>&1 || { echo "no wheels in $1/: run 'bash $0 fetch' here and carry $1"; exit 2; }
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$1"/*.whl \
    || { echo "pip install of $1 failed"; exit 2; }
  touch "/tmp/site/.installed-$(basename "$1")"
}

gpu() {  # the preconditions every phase shares
  "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" \
    || { echo "no CUDA GPU visible to $PY"; exit 2; }
  nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader | tee "$out/gpu.txt"
}

pack() {  # PHASE's files as one tarball beside them
  tar czf "$out/$phase.tar.gz" -C "$out" --exclude "*.tar.gz" . && ls -la "$out"
}

case $phase in
  cuda-tests)
    gpu
    timeout 540 "$PY" -m pytest tests/unittest/_torch/attention/test_fp8_cuda.py tests/unittest/_torch/speculative/test_speculative_cuda.py \
      tests/unittest/_torch/attention/test_cuda.py tests/unittest/_torch/pyexecutor/sampling/test_beam_search_cuda.py \
      -q -rs -p no:cacheprovider --durations=8 2>&1 | tee "$out/pytest_cuda.log" | tail -25
    ;;
  stage-smollm2)
    [ -f .carry/smollm2-a.part ] || { echo "carry .carry/smollm2-a.part (bash $0 fetch makes it)"; exit 2; }
    mkdir -p /tmp/stage && cp .carry/smollm2-a.part /tmp/stage/ && ls -la /tmp/stage
    ;;
  speculative)
    setup .carry/gguf; gpu
    [ -f /tmp/stage/smollm2-a.part ] || { echo "run stage-smollm2 first (within 30 s: the machine must stay warm)"; exit 2; }
    [ -f .carry/smollm2-b.part ] || { echo "carry .carry/smollm2-b.part"; exit 2; }
    cat /tmp/stage/smollm2-a.part .carry/smollm2-b.part > /tmp/stage/smollm2.gguf
    model=/tmp/stage/smollm2.gguf
    for b in 1 4 8; do
      timeout 200 "$PY" -m benchmarks.model.speculative --model "$model" --device cuda --dtype bfloat16 --workloads repetitive \
        --batch $b --max-tokens 256 --repeats 3 --json "$out/speculative_b$b.json" 2>&1 | grep -v "^INFO" | tee -a "$out/speculative.log"
    done
    for b in 1 8; do
      timeout 120 "$PY" -m benchmarks.model.speculative --model "$model" --device cuda --dtype bfloat16 --workloads repetitive \
        --batch $b --max-tokens 256 --repeats 3 --disable-overlap-scheduler --json "$out/speculative_b${b}_no_overlap.json" \
        2>&1 | grep -v "^INFO" | tee -a "$out/speculative.log"
    done
    # where drafts do not pay (64 requests at once): max_concurrency and the threshold turn them off
    timeout 150 "$PY" -m benchmarks.model.speculative --model "$model" --device cuda --dtype bfloat16 --workloads default \
      --num-requests 64 --max-prompt-len 2048 --max-num-tokens 8192 --max-tokens 128 --repeats 3 --max-concurrency 16 \
      --acceptance-rate-threshold 0.3 --json "$out/speculative_default_64.json" 2>&1 | grep -v "^INFO" | tee -a "$out/speculative.log"
    pack
    ;;
  fp8-decode)
    gpu
    timeout 520 "$PY" -m benchmarks.gpu.fp8 --out "$out" --sections decode 2>&1 | tee "$out/fp8_decode.log" | tail -12
    pack
    ;;
  fp8-roofline)
    gpu
    deadline=$((SECONDS + 515))  # every step fits in what is left of 8.6 minutes
    left() { local cap=$1 rest=$((deadline - SECONDS)); echo $(( rest < cap ? rest : cap )); }
    step() {  # step CAP NAME COMMAND...: run it if at least 20 s are left, at most CAP seconds
      local cap=$1 name=$2; shift 2
      local t; t=$(left "$cap")
      if [ "$t" -lt 20 ]; then echo "== $name: skipped, no time left" | tee -a "$out/skipped.txt"; return 0; fi
      echo "== $name (at most $t s)"
      timeout "$t" "$@" > "$out/$name.log" 2>&1; echo "   exit $? after $((SECONDS - start_s)) s"; tail -4 "$out/$name.log"
    }
    start_s=$SECONDS
    step 100 fp8_kernel "$PY" -m benchmarks.gpu.fp8 --out "$out" --sections kernel
    step 150 pytest "$PY" -m pytest tests/unittest/_torch/attention/test_fp8_cuda.py -q -rs -p no:cacheprovider \
      -k "reads_half or twice_the_blocks or kv_write or fused_decoder"
    step 150 decode_profile "$PY" -m benchmarks.gpu.decode_profile --out "$out" --batches 1,16,64,256 --profile 1,64
    step 100 decode_profile_fp8 "$PY" -m benchmarks.gpu.decode_profile --out "$out" --batches 64,256 --profile "" \
      --kv-cache-dtype fp8
    step 150 engine_fp8 "$PY" -m benchmarks.gpu.engine_fp8 --out "$out" --concurrency 1,16,64 --seconds 10
    step 90 decode_profile_unfused "$PY" -m benchmarks.gpu.decode_profile --out "$out" --batches 1,64 --profile "" --unfused
    "$PY" -m benchmarks.gpu.roofline_summary "$out" | tee "$out/summary.txt"
    pack
    ;;
  fp8-replay)
    gpu
    timeout 520 "$PY" -m benchmarks.gpu.fp8 --out "$out" --sections replay --requests "${1:-150}" 2>&1 \
      | tee "$out/fp8_replay.log" | tail -12
    pack
    ;;
  peer-bf16|peer-fp8)
    setup .whl; gpu
    [ -f .carry/smollm2-tokenizer/tokenizer.json ] || { echo "carry .carry/smollm2-tokenizer"; exit 2; }
    kv=auto; [ "$phase" = peer-fp8 ] && kv=fp8
    timeout 530 "$PY" -m benchmarks.gpu.peer_serving --out "$out" --kv-cache-dtype $kv --tokenizer .carry/smollm2-tokenizer \
      --shapes 1024/128,1024/1024 --concurrency "${1:-1,8,32,64,128}" --seconds "${2:-25}" 2>&1 | tee "$out/peer_$kv.log" | tail -12
    pack
    ;;
  peer-engine)
    setup .whl; gpu
    [ -f .carry/smollm2-tokenizer/tokenizer.json ] || { echo "carry .carry/smollm2-tokenizer"; exit 2; }
    for kv in auto fp8; do
      timeout 250 "$PY" -m benchmarks.gpu.peer_serving --out "$out" --section engine --kv-cache-dtype $kv \
        --tokenizer .carry/smollm2-tokenizer --shapes 1024/128,1024/1024 --concurrency "${1:-1,8,32,64,128}" \
        --seconds "${2:-15}" 2>&1 | tee "$out/engine_$kv.log" | tail -6
    done
    pack
    ;;
  hf-checkpoints)
    setup .whl; gpu
    timeout 540 "$PY" -m benchmarks.gpu.hf_checkpoints --out "$out" --models "${1:-llama-3.1-8b}" 2>&1 \
      | tee "$out/hf_checkpoints.log" | tail -20
    pack
    ;;
  nccl)
    echo "NCCL ranks are not built: LLM(device='cuda', tensor_parallel_size=2) is refused by name (docs/gpu.md)"
    exit 3
    ;;
  *) echo "unknown phase $phase"; exit 2 ;;
esac
