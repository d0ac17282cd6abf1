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

test: $(STAMP)
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadscope $(ARGS)

clean:
	rm -rf $(VENV) .flywheel
