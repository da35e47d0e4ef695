#!/usr/bin/env bash
# Fetch, into .whl/, the Python 3.12 x86-64 wheels that the H200 image lacks (the server, its
# client and the model readers), at the versions this checkout's .venv holds, so that the GPU
# runs use what the tests ran with. benchmarks/gpu/h200_serving.sh setup installs them there into /tmp/site.
#   bash benchmarks/gpu/fetch_wheels.sh      (after `make .venv/.installed`)
set -euo pipefail
cd "$(dirname "$0")/../.."
exclude=$(git rev-parse --git-path info/exclude)
grep -qx '/.whl/' "$exclude" 2>/dev/null || echo /.whl/ >> "$exclude"
names=(fastapi starlette pydantic pydantic-core typing-inspection annotated-types annotated-doc
       opentelemetry-api uvicorn openai httpx2 httpcore2 truststore jiter sniffio gguf
       llguidance jsonschema jsonschema-specifications referencing rpds-py)
pins=()
for name in "${names[@]}"; do
  version=$(.venv/bin/python -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$name" 2>/dev/null) \
    || { echo "skip $name: not in .venv" >&2; continue; }
  pins+=("$name==$version")
done
platforms=()
for tag in manylinux_2_39 manylinux_2_35 manylinux_2_34 manylinux_2_31 manylinux_2_28 manylinux_2_27 manylinux_2_24 manylinux_2_17 manylinux2014 manylinux1; do
  platforms+=(--platform "${tag}_x86_64")
done
.venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp "${platforms[@]}" -d .whl "${pins[@]}"
ls .whl
