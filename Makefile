# ddtree — every target sets up what it needs (a .venv in the repo, editable install).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# CPU build from local disk by default; GPU users: make install TORCH_SPEC="torch"
TORCH_SPEC ?= torch==2.13.0
STAMP  := $(VENV)/.installed

.PHONY: install test test-slow test-all test-servers test-gpu-stack run bench docs lint toy toy-pure clean device-kit

$(STAMP): pyproject.toml setup.py ddtree/engine/_hosttree.c
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[test]"
	touch $(STAMP)

install: $(STAMP)

# two workers, one file each at a time (module fixtures built once): the tests run one thread each (conftest)
PYTEST_WORKERS ?= 2
test: $(STAMP)
	$(PY) -m pytest -q -n $(PYTEST_WORKERS) --dist loadfile

test-slow: $(STAMP)
	$(PY) -m pytest -q -m "slow and not servers"

test-all: $(STAMP)
	$(PY) -m pytest -q -m "not servers"

# python -m ddtree.check against real serving engines (tests/test_check_servers.py): llama-cpp-python's server, installed
# into .venv-servers (DDTREE_SERVERS_VENV) from the package registry; the first run builds llama.cpp from source
# (28 min on a busy 2-core machine) and converts assets/toy_pure to GGUF f32. Not in CI. A failed install fails here (skips elsewhere).
test-servers: $(STAMP)
	DDTREE_SERVERS_REQUIRED=1 OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 $(PY) -m pytest -q -rs -s -m servers tests/test_check_servers.py

run: $(STAMP)
	HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 $(PY) -m ddtree.run experiment=toy method=dflash force=true
	HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 $(PY) -m ddtree.run experiment=toy method=mtp force=true
	HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 $(PY) -m ddtree.run experiment=toy force=true -m
	HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 $(PY) -m ddtree.run experiment=toy_dflash2 method=dflash,ddtree force=true -m

# each script prints its table and writes its record under docs/bench/ (bench/README.md)
bench: $(STAMP)
	$(PY) bench/bench_tree.py
	$(PY) bench/bench_stages.py
	OMP_NUM_THREADS=1 $(PY) bench/bench_round.py
	OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 $(PY) bench/bench_overhead.py
	OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 $(PY) bench/bench_engines.py --out runs/bench_engines.md
	OMP_NUM_THREADS=1 $(PY) bench/bench_launches.py --out runs/bench_launches.json
	OMP_NUM_THREADS=1 $(PY) bench/bench_launches.py --concurrency 1,8,32 --structures qwen3_6_27b,qwen3_8b --rounds 4
	OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 $(PY) bench/bench_concurrency.py --runs 5 --new 64

# the wheels the GPU machine's image lacks, for its Python 3.12, in .kit/ (docs/gpu.md: one `device` run)
device-kit: $(STAMP)
	PYTHON=$(PY) bench/device_kit.sh

# the fast suite on the GPU machine's stack, on this CPU: Python 3.12, torch 2.11.0 and triton 3.6.0 (PyPI's CUDA build),
# transformers 5.17 with the kit (.kit/: hydra-core, omegaconf, antlr4, transformers 5.22) on PYTHONPATH as
# bench/device_all.sh puts it; a venv of its own, .venv-gpu-stack (~4.6 GB, ~2.2 GB downloaded). Not in CI (docs/gpu.md).
# PYTEST_ARGS: some tests only, e.g. PYTEST_ARGS="tests/test_launches.py -k once"
test-gpu-stack:
	bench/gpu_stack.sh $(PYTEST_ARGS)

# regenerate the generated pages: README's model/method table, docs/benchmarks.md (from docs/bench/*.json), paper tables
docs: $(STAMP)
	$(PY) -m ddtree.docs

lint: $(STAMP)
	$(PY) -m ruff check ddtree compat tests bench toy

# rebuild assets/toy from scratch: corpus, tokenizer, target pretraining, drafter training (~26 min, 1 thread)
toy: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) toy/build.py --clean

# rebuild assets/toy_pure: the same corpus and recipe with a pure-attention Qwen3 target
toy-pure: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) toy/build.py --clean --arch qwen3 --name toy_pure

clean:
	rm -rf $(VENV) runs/* .pytest_cache
