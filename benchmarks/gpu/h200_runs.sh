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
#   fp8-kernel            []                                ~7 min   the FP8 decode kernel against bf16 with its sweep (queued
#                                                                    timing; the table read ahead in 3 and 4 stages among the
#                                                                    shapes), then the CUDA tests in what is left of 9 minutes:
#                                                                    the first call on a machine that may not come twice
#   stage-smollm2         [.carry/smollm2-a.part]           ~10 s    half of SmolLM2's GGUF to /tmp/stage (the working tree
#                                                                    travels in at most 64 MiB; the file is 94 MiB)
#   speculative           [.carry/gguf .carry/smollm2-b.part] ~2.5 min right after stage-smollm2 (the machine keeps /tmp
#                                                                    for 30 s): benchmarks.model.speculative, SmolLM2 bf16, overlap
#                                                                    on (the default) and off side by side: repetitive at batch
#                                                                    1/4/8; 64 requests of the default scenario (max_concurrency 16,
#                                                                    threshold 0.3); then float32, overlap on: outputs must equal
#                                                                    plain decoding's (MISMATCH lines and exit 1 otherwise); then
#                                                                    benchmarks.gpu.draft_step_profile at batch 1: host ms per step
#                                                                    (drafting with the fused kernel / the torch form / plain),
#                                                                    the profiler's top host ops, launches and blocking calls
#   fp8-decode            []                                ~4 min   decode 64 x 8k and 256 x 2k, bf16 vs FP8 pools, roofline
#   fp8-replay            []       [REQUESTS]               ~6 min   the default scenario, same pool bytes in bf16 and FP8
#   fp8-roofline          []                                ~7 min   the FP8 decode kernel against bf16 (TB/s, a sweep of shapes),
#                                                                    the two CUDA tests it must pass and the fused-layer ones,
#                                                                    the 8B decode step against its rooflines (bf16 batch 1/16/
#                                                                    64/256 profiled at 1 and 64; FP8 at 64 and 256), the
#                                                                    in-process engine FP8 vs bf16 at c=1/16/64, the unfused
#                                                                    layers at batch 1 and 64 if time is left; a table last
#   fp8-engine            []                                ~4 min   the in-process engine FP8 vs bf16 at c=1/16/64 on the same
#                                                                    work (a 5-s warm-up each, then 2 alternating rounds of a fixed
#                                                                    number of requests per worker), each run's iterations (mixed /
#                                                                    decode-only / idle), one more 1.5-s run of each at c=16 under the
#                                                                    profiler (kernels per iteration), then the FP8 kernel (queued
#                                                                    timing) and the shipped kernel and the per-position-sum form in
#                                                                    two and three stages
#   peer-bf16, peer-fp8   [.carry/peer-site.tar.xz .carry/smollm2-tokenizer]  [SECONDS [VOCAB [SHAPES]]]  ~7 min
#                                                                    Llama-3.1-8B-shaped checkpoint (128,256 rows; VOCAB=tokenizer:
#                                                                    49,152) written on the machine, trtllm-serve, GuideLLM 0.8.1
#                                                                    sampled and temperature 0, 1024/128 and 1024/1024 at
#                                                                    concurrency 1, 16, 64, 128 (SECONDS each, default 10;
#                                                                    SHAPES default 1024/128,1024/1024)
#   peer-engine           [.carry/peer-site.tar.xz .carry/smollm2-tokenizer]  [SECONDS]  ~7.5 min
#                                                                    the same shapes, levels and samplings through LLM in-process,
#                                                                    bf16 then FP8 KV (SECONDS each, default 8)
#                         afterwards, HERE: python -m benchmarks.gpu.peer_summary OUT... (the comparison table)
#   hf-checkpoints        [.whl]           [MODEL]          ~8 min   a random bf16 sharded checkpoint written by transformers on
#                                                                    the machine (llama-3.1-8b, or qwen3-8b), served by
#                                                                    trtllm-serve DIR: load time, GPU memory, the default scenario at 1x
#   sampling              []                                ~4 min   the device sampling pass: its CUDA tests, then
#                                                                    benchmarks.model.sampling_speed (Llama-3.1-8B shape, batch
#                                                                    1/16/64/256 over 1024 cached tokens): greedy vs sampled,
#                                                                    top-k/top-p, logprobs, penalties, mixed rows (A/B per round)
#   nccl                  (a 2-GPU host)                             not built: says so and stops
set -uo pipefail
PY=${PY:-python3}
phase=${1:?PHASE}
here=$(cd "$(dirname "$0")/../.." && pwd)
cd "$here"

if [ "$phase" = fetch ]; then  # here, where the package registry is
  set -e
  bash benchmarks/gpu/fetch_wheels.sh > /dev/null
  # GuideLLM 0.8.1 and everything it requires beyond the image's torch and transformers, at the versions the
  # suite's client venv resolved and ran (tests/unittest/serve/test_benchmark_client.py); site_check below
  # proves nothing is missing
  extra=(guidellm==0.8.1 culsans==0.10.0 aiologic==0.17.1 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19
         eval_type_backport==0.4.0 faker==40.63.0 ftfy==6.3.1 wcwidth==0.9.5 loguru==0.7.3 pydantic-settings==2.16.3
         python-dotenv==1.2.4 more-itertools==11.2.1 h2==4.4.1 hpack==4.2.0 hyperframe==6.1.0 typing-extensions==4.16.0
         click==8.4.2 websockets==17.4 msgpack==1.2.4 uvloop==0.23.0 wrapt==2.5.2 rich==15.0.0 markdown-it-py==4.3.0
         mdurl==0.1.2 pygments==2.21.0 pandas==3.1.1 python-dateutil==4.0.0 tzdata==2026.6 pyarrow==26.0.1
         xxhash==4.1.0 httpx==0.29.0 httpcore==1.0.9 h11==0.16.0 anyio==4.16.0 idna==3.21 certifi==2026.10.19.post1
         protobuf==7.36.2 tabulate==0.10.0 sanic==25.12.1 sanic-routing==23.12.0 httptools==0.9.0 ujson==6.1.0
         aiofiles==25.1.0 multidict==6.9.1 html5tagger==2.0.0 tracerite==2.6.5 prometheus-client==0.26.0)
  # of the server's wheels, what trtllm-serve and the peer phases import (openai: benchmarks.serving's client,
  # which the server harness imports; no llguidance, gguf, jsonschema: not used here)
  server=(fastapi starlette pydantic pydantic_core typing_inspection annotated_types annotated_doc opentelemetry_api
          uvicorn httpx2 httpcore2 truststore sniffio openai jiter)
  tmp=$(mktemp -d)
  platforms=()
  for tag in manylinux_2_39 manylinux_2_35 manylinux_2_34 manylinux_2_31 manylinux_2_28 manylinux_2_24 manylinux_2_17 manylinux2014 manylinux1; do
    platforms+=(--platform "${tag}_x86_64")
  done
  target=(--only-binary=:all: --python-version 3.12 --implementation cp "${platforms[@]}")
  .venv/bin/python -m pip download -q --no-deps "${target[@]}" -d "$tmp/wheels" "${extra[@]}"
  # The peer phases' site: those wheels installed for Python 3.12 here and packed with xz (pyarrow alone is a
  # 55 MB wheel; a device call carries 64 MiB in all, the checkout's 9 MB included). Left out: tests, headers,
  # and pyarrow's Flight and S3 libraries (48 MB; only pyarrow.flight and pyarrow.fs's S3 support load them,
  # and pyarrow.fs takes their absence).
  .venv/bin/python -m pip install -q --no-deps --no-compile "${target[@]}" --target "$tmp/site" \
    $(for name in "${server[@]}"; do ls .whl/"$name"-*.whl; done) "$tmp"/wheels/*.whl
  rm -rf "$tmp/site/bin" "$tmp/site/pandas/tests" "$tmp/site/pyarrow/tests" "$tmp/site/pyarrow/include" \
    "$tmp"/site/pyarrow/libarrow_flight.so* "$tmp"/site/pyarrow/libarrow_python_flight.so* \
    "$tmp"/site/pyarrow/_flight.*.so "$tmp"/site/pyarrow/libarrow_s3.so* "$tmp"/site/pyarrow/_s3fs.*.so
  .venv/bin/python -m benchmarks.gpu.site_check "$tmp/site" --python-version 3.12
  exclude=$(git rev-parse --git-path info/exclude)
  grep -qx '/.carry/' "$exclude" 2>/dev/null || echo /.carry/ >> "$exclude"
  mkdir -p .carry
  tar -C "$tmp/site" -cf - . | xz -6 -T0 > .carry/peer-site.tar.xz
  rm -rf "$tmp"
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

peer_setup() {  # the peer phases' site (server + GuideLLM, Python 3.12), unpacked once per machine; their work dir
  work=/tmp/peer/$phase && rm -rf "$work" && mkdir -p "$work"  # OUT gets the tarball, the records, the log
  [ -f .carry/smollm2-tokenizer/tokenizer.json ] || { echo "carry .carry/smollm2-tokenizer"; exit 2; }
  [ -f /tmp/site/.installed-peer-site ] && return 0
  [ -f .carry/peer-site.tar.xz ] || { echo "carry .carry/peer-site.tar.xz (bash $0 fetch makes it)"; exit 2; }
  mkdir -p /tmp/site && "$PY" -c "import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2], filter='data')" \
    .carry/peer-site.tar.xz /tmp/site || { echo "unpacking .carry/peer-site.tar.xz failed"; exit 2; }
  "$PY" -c "import guidellm.benchmark, guidellm.data, datasets, pyarrow.parquet, fastapi, uvicorn, prometheus_client" \
    || { echo "the peer site does not import"; exit 2; }
  touch /tmp/site/.installed-peer-site
}

peer_pack() {  # at most 8 files come back: PHASE.tar.gz (everything), the records and the phase's logs beside it
  tar czf "$out/$phase.tar.gz" -C "$work" . && cp "$work"/peer_*.json "$work"/engine_*.json "$work"/peer_*.log \
    "$work"/engine_*.log "$out"/ 2>/dev/null
  ls -la "$out"
}

gpu() {  # the preconditions every phase shares
  "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" \
    || { echo "no CUDA GPU visible to $PY"; exit 2; }
  nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader | tee "$out/gpu.txt"
}

cuda_tests() {  # cuda_tests SECONDS: the CUDA tests (FP8, drafts, graphs, beams, attention, device sampling)
  timeout "$1" "$PY" -m pytest tests/unittest/_torch/attention/test_fp8_cuda.py tests/unittest/_torch/speculative/test_speculative_cuda.py \
    tests/unittest/_torch/attention/test_cuda.py tests/unittest/_torch/pyexecutor/sampling/test_beam_search_cuda.py \
    tests/unittest/_torch/pyexecutor/sampling/test_device_sampling_cuda.py \
    -q -rs -p no:cacheprovider --durations=8 2>&1 | tee "$out/pytest_cuda.log" | tail -25
}

fp8_kernel() {  # fp8_kernel SECONDS LINES: the FP8 decode kernel against bf16 and its sweep, the log's last LINES
  timeout "$1" "$PY" -m benchmarks.gpu.fp8 --out "$out" --sections kernel > "$out/fp8_kernel.log" 2>&1
  echo "fp8 kernel exit $?"; tail -"$2" "$out/fp8_kernel.log"
}

pack() {  # PHASE's files as one tarball beside them
  tar czf "$out/$phase.tar.gz" -C "$out" --exclude "*.tar.gz" . && ls -la "$out"
}

case $phase in
  cuda-tests)
    gpu
    cuda_tests 540
    ;;
  fp8-kernel)
    gpu
    fp8_kernel 150 30
    cuda_tests 380
    pack
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
    spec=(-m benchmarks.model.speculative --model "$model" --device cuda --overlap on,off --repeats 3)
    # drafts against plain decoding, each with the overlap scheduler on and off (a pair of LLMs per mode)
    timeout 230 "$PY" "${spec[@]}" --dtype bfloat16 --workloads repetitive --batch 1,4,8 --max-tokens 256 \
      --json "$out/speculative_repetitive.json" 2>&1 | grep -v "^INFO" | tee -a "$out/speculative.log"
    # where drafts do not pay (64 requests at once): max_concurrency and the threshold turn them off
    timeout 180 "$PY" "${spec[@]}" --dtype bfloat16 --workloads default --num-requests 64 --max-prompt-len 2048 \
      --max-num-tokens 8192 --max-tokens 128 --max-concurrency 16 --acceptance-rate-threshold 0.3 \
      --json "$out/speculative_default_64.json" 2>&1 | grep -v "^INFO" | tee -a "$out/speculative.log"
    # float32: the same workloads with greedy outputs required equal (a verification step's GEMMs then
    # round like a decode step's up to float32's precision, far below SmolLM2's argmax margins)
    timeout 120 "$PY" "${spec[@]}" --overlap on --repeats 1 --dtype float32 --workloads repetitive,default --batch 8 \
      --num-requests 64 --max-prompt-len 2048 --max-num-tokens 8192 --max-tokens 128 --max-concurrency 16 \
      --acceptance-rate-threshold 0.3 --json "$out/speculative_float32.json" 2>&1 | grep -v "^INFO" \
      | tee -a "$out/speculative.log"
    # where a drafting step's host time goes (batch 1, overlap on): the fused kernel, the torch form and plain
    # steps alternated, then torch.profiler over 24 drafting steps (top host ops, launches, blocking calls)
    timeout 150 "$PY" -m benchmarks.gpu.draft_step_profile --model "$model" --dtype bfloat16 --batch 1 --steps 24 \
      --json "$out/draft_step_profile.json" 2>&1 | grep -v "^INFO" | tee "$out/draft_step_profile.log" | tail -40
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
    # the FP8 kernel against a lean copy of its form, with the split's unknown start, signed and unsigned, and the
    # ceilings without V's conversion and dot (fp8_mma_forms)
    step 80 fp8_forms "$PY" -m benchmarks.gpu.fp8_mma_forms --forms t_qk8r,t_qk8r_split,t_qk8r_split_u,t_qk8r_vbytes,t_qk8r_nov \
      --tiles 64:4:2 --json "$out/fp8_mma_forms.json"
    step 150 pytest "$PY" -m pytest tests/unittest/_torch/attention/test_fp8_cuda.py -q -rs -p no:cacheprovider \
      -k "twice_the_blocks or kv_write or fused_decoder"
    step 150 decode_profile "$PY" -m benchmarks.gpu.decode_profile --out "$out" --batches 1,16,64,256 --profile 1,64
    step 100 decode_profile_fp8 "$PY" -m benchmarks.gpu.decode_profile --out "$out" --batches 64,256 --profile "" \
      --kv-cache-dtype fp8
    step 150 engine_fp8 "$PY" -m benchmarks.gpu.engine_fp8 --out "$out" --concurrency 1,16,64 --seconds 5 --rounds 3
    step 90 decode_profile_unfused "$PY" -m benchmarks.gpu.decode_profile --out "$out" --batches 1,64 --profile "" --unfused
    "$PY" -m benchmarks.gpu.roofline_summary "$out" | tee "$out/summary.txt"
    pack
    ;;
  fp8-engine)
    gpu
    timeout 230 "$PY" -m benchmarks.gpu.engine_fp8 --out "$out" --concurrency 1,16,64 --seconds 5 --rounds 2 --profile-level 16 \
      > "$out/engine_fp8.log" 2>&1; echo "engine_fp8 exit $?"; tail -30 "$out/engine_fp8.log"
    fp8_kernel 90 6
    timeout 60 "$PY" -m benchmarks.gpu.fp8_mma_forms --forms t_qk8r_lazyl --tiles 64:4:2,64:4:3 \
      --json "$out/fp8_mma_forms.json" > "$out/fp8_forms.log" 2>&1; echo "forms exit $?"; tail -6 "$out/fp8_forms.log"
    pack
    ;;
  fp8-replay)
    gpu
    timeout 520 "$PY" -m benchmarks.gpu.fp8 --out "$out" --sections replay --requests "${1:-150}" 2>&1 \
      | tee "$out/fp8_replay.log" | tail -12
    pack
    ;;
  peer-bf16|peer-fp8)
    peer_setup; gpu
    kv=auto; [ "$phase" = peer-fp8 ] && kv=fp8
    timeout 540 "$PY" -m benchmarks.gpu.peer_serving --out "$work" --kv-cache-dtype $kv --tokenizer .carry/smollm2-tokenizer \
      --vocab "${2:-model}" --shapes "${3:-1024/128,1024/1024}" --concurrency 1,16,64,128 --seconds "${1:-10}" --budget-s 500 \
      2>&1 | grep -v "^INFO" | tee "$work/peer_$kv.log" | tail -12
    peer_pack
    ;;
  peer-engine)
    peer_setup; gpu
    started=$(date +%s)
    for kv in auto fp8; do  # bf16 gets half the time left (and any it leaves goes to FP8)
      left=$(( 520 - ($(date +%s) - started) ))
      budget=$left; [ $kv = auto ] && budget=$(( left / 2 + 20 ))
      timeout $((budget + 20)) "$PY" -m benchmarks.gpu.peer_serving --out "$work" --section engine --kv-cache-dtype $kv \
        --tokenizer .carry/smollm2-tokenizer --shapes 1024/128,1024/1024 --concurrency 1,16,64,128 \
        --seconds "${1:-8}" --budget-s $budget 2>&1 | grep -v "^INFO" | tee "$work/engine_$kv.log" | tail -6
    done
    peer_pack
    ;;
  hf-checkpoints)
    setup .whl; gpu
    timeout 540 "$PY" -m benchmarks.gpu.hf_checkpoints --out "$out" --models "${1:-llama-3.1-8b}" 2>&1 \
      | tee "$out/hf_checkpoints.log" | tail -20
    pack
    ;;
  sampling)
    gpu
    timeout 150 "$PY" -m pytest tests/unittest/_torch/pyexecutor/sampling/test_device_sampling_cuda.py \
      tests/unittest/_torch/pyexecutor/sampling/test_device_sampling.py -q -rs -p no:cacheprovider 2>&1 \
      | tee "$out/pytest_sampling.log" | tail -6
    timeout 330 "$PY" -m benchmarks.model.sampling_speed --device cuda --repeats 20 --json "$out/sampling_speed.json" \
      2>&1 | grep -v "^INFO" | tee "$out/sampling_speed.log" | tail -8
    pack
    ;;
  nccl)
    echo "NCCL ranks are not built: LLM(device='cuda', tensor_parallel_size=2) is refused by name (docs/gpu.md)"
    exit 3
    ;;
  *) echo "unknown phase $phase"; exit 2 ;;
esac
