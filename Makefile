# Two commands do all set-up on a fresh machine: `make demo` (the main job) and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: demo test install clean

$(VENV)/.installed: pyproject.toml setup.py $(wildcard */*.c)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -U pip setuptools wheel
	$(PY) -m pip install -q -e '.[dev]'
	# NIXL (UCX on CPU) for the transfer tests; --no-deps: its metadata asks for PyTorch, which it does not need here.
	$(PY) -m pip install -q --no-deps nixl-cu12
	touch $@

install: $(VENV)/.installed

demo: install
	$(VENV)/bin/kvcache plan --example llama-3.1-70b --gpu-memory 80GiB --tp 8 --quant block_wise_fp8 --host-memory 512GiB

test: install
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV) build dist *.egg-info
