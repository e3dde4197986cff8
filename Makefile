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

# The demo's model runs on Paddle (CPU), from a checkpoint it writes and reads with safetensors.
$(VENV)/.demo-deps: $(VENV)/.base
	$(PY) -m pip install -q 'paddlepaddle>=2.6' 'safetensors>=0.4'
	touch $@

# A tiny Mistral checkpoint (random weights) through examples/engine/generate.py --daemon: a real kvcache serve.
demo: $(VENV)/.demo-deps
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

# FastDeploy's own tests with kvcache's PrefixCacheManager swapped in (tests/fastdeploy_plugin.py), then
# tests/test_fastdeploy.py: FastDeploy's scheduler on kvcache. FastDeploy's sources come from the shared tarball
# (FD_TARBALL), unpacked under build/; the environment is a venv of its own (CPU Paddle and FastDeploy's
# pure-Python requirements), apart from $(VENV). docs/integrations.md says what passes and what is out of scope.
FD_TARBALL ?= $(firstword $(wildcard ../shared/peers/fastdeploy-*.tgz shared/peers/fastdeploy-*.tgz))
FD_SRC ?= build/fastdeploy-src
FD_VENV ?= build/fastdeploy-venv
FD_PY = $(FD_VENV)/bin/python
FD_TESTS = tests/v1/cache_manager/test_prefix_cache.py tests/v1/test_resource_manager_v1.py \
	tests/engine/test_resource_manager.py tests/cache_manager/test_prefix_cache_manager.py
FD_LOG_DIR ?= $(CURDIR)/build/fastdeploy-log
FD_PYTEST = cd $(FD_SRC) && FD_LOG_DIR=$(FD_LOG_DIR) PYTHONPATH=$(CURDIR)/$(FD_SRC):$(CURDIR)/tests \
	$(CURDIR)/$(FD_PY) -m pytest -p fastdeploy_plugin --fd-platform-cuda -q

$(FD_SRC)/.unpacked:
	@test -n "$(FD_TARBALL)" || { echo "FD_TARBALL: no fastdeploy-*.tgz in ../shared/peers/; set FD_TARBALL"; exit 1; }
	rm -rf $(FD_SRC) && mkdir -p $(FD_SRC) && tar xzf $(FD_TARBALL) -C $(FD_SRC)
	touch $@

# Every package pinned (tests/fastdeploy-requirements.txt) and installed by uv without resolving: the same
# environment on every machine, about two minutes from nothing. A half-built venv is started again.
FD_REQUIREMENTS = tests/fastdeploy-requirements.txt
FD_UV = $(FD_VENV)/bin/uv pip install -q --python $(FD_PY) --no-deps
$(FD_VENV)/.installed: $(FD_REQUIREMENTS)
	rm -rf $(FD_VENV)
	$(PYTHON) -m venv $(FD_VENV)
	$(FD_PY) -m pip install -q --disable-pip-version-check 'uv==0.13.8'
	$(FD_UV) -r $(FD_REQUIREMENTS)
	$(FD_UV) -e .
	touch $@

.PHONY: test-fastdeploy
test-fastdeploy: $(FD_SRC)/.unpacked $(FD_VENV)/.installed
	$(FD_PYTEST) $(FD_TESTS)
	@echo "test_prefix_cache.py with every prefix forgotten before each match (two of its tests judge hits):"
	$(FD_PYTEST) --fd-kvcache-no-hits tests/v1/cache_manager/test_prefix_cache.py | tee $(CURDIR)/build/fd-no-hits.log; \
		grep -q "2 failed, 2 passed" $(CURDIR)/build/fd-no-hits.log
	FD_LOG_DIR=$(FD_LOG_DIR) PYTHONPATH=$(CURDIR)/$(FD_SRC) $(FD_PY) -m pytest -q tests/test_fastdeploy.py
