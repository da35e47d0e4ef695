# Set-up is part of every target: the first run creates .venv and installs
# the project (torch 2.13.0 CPU, pinned) with its test and bench extras.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
HYPOTHESIS_PROFILE ?= ci

.PHONY: test replay thorough overhead clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test,bench]'
	touch $(STAMP)

test: $(STAMP)
	HYPOTHESIS_PROFILE=$(HYPOTHESIS_PROFILE) $(PY) -m pytest tests

thorough: $(STAMP)
	HYPOTHESIS_PROFILE=thorough $(PY) -m pytest tests -k "property or stateful"

replay: $(STAMP)
	$(PY) -m benchmarks.replay --json replay.json --plot replay.png

overhead: $(STAMP)
	$(PY) -m benchmarks.overhead --json overhead.json

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis replay.json replay.png overhead.json
