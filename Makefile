# Two commands do all set-up on a fresh machine: `make demo` (the main job) and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: demo test docs install clean

# The package and its core dependencies: all the demo needs. A venv set up for the tests keeps its editable
# install (rebuilt here when the sources changed) instead of getting a copy that would shadow it.
$(VENV)/.base: pyproject.toml setup.py $(wildcard */*.c) $(wildcard */*.h)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -U pip setuptools wheel
	if [ -f $(VENV)/.installed ]; then $(PY) -m pip install -q -e '.[dev]'; else $(PY) -m pip install -q .; fi
	touch $@

# What the tests need on top: test tools, Paddle (CPU) and NIXL (UCX on CPU). --no-deps for NIXL: its metadata
# asks for PyTorch, which it does not need here.
$(VENV)/.installed: $(VENV)/.base
	$(PY) -m pip install -q -e '.[dev]'
	$(PY) -m pip install -q --no-deps nixl-cu12
	touch $@

install: $(VENV)/.installed

# The demo's model runs on Paddle (CPU).
$(VENV)/.demo: $(VENV)/.base
	$(PY) -m pip install -q 'paddlepaddle>=2.6'
	touch $@

demo: $(VENV)/.demo
	$(PY) examples/engine/demo.py

test: $(VENV)/.installed
	$(PY) -m pytest -q

# The API reference, from the docstrings, into build/api/ (fails on any warning).
docs: $(VENV)/.base
	$(PY) -m pip install -q pdoc
	$(PY) docs/build_api.py build/api
	@echo "API reference: build/api/index.html"

clean:
	rm -rf $(VENV) build dist *.egg-info

# NVIDIA Dynamo's KV router (its runtime wheel: pydantic and uvloop besides), for tests/test_dynamo.py: Dynamo's own
# indexer subscribed to several daemons' KV events.
.PHONY: dynamo
dynamo: $(VENV)/.installed
	$(PY) -m pip install -q ai-dynamo-runtime==1.6.1
