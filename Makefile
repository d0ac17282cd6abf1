# Two entry points: `make demo` and `make test`. Both create .venv and install first.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test install clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/flywheel demo $(ARGS)

# Workers for the suite: most tests wait on processes, brokers and timeouts rather than compute,
# so three share two cores well; a module's tests stay on one worker (its fixtures start once).
TEST_WORKERS ?= 3

# The console's browser tests drive Debian's chromium (never a browser Playwright downloads): installed
# here when it is missing and make runs as root (CI does); otherwise a warning, and those tests fail
# saying how to install it.
test: $(STAMP)
	@command -v chromium >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ]; then \
	    echo "make test: installing chromium for the console's browser tests (apt-get)"; \
	    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
	        chromium fonts-dejavu-core >/dev/null; } || echo "make test: warning: could not install chromium" >&2; \
	  else \
	    echo "make test: warning: chromium is not on PATH and only root may apt-get it; the browser tests will fail" >&2; \
	  fi; }
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadscope $(ARGS)

clean:
	rm -rf $(VENV) .flywheel
