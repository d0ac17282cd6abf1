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

test: $(STAMP)
	$(BIN)/python -m pytest $(ARGS)

clean:
	rm -rf $(VENV) .flywheel
