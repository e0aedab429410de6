# Every target sets itself up on a fresh machine (Python 3.11, no GPU, no conda).
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)

.PHONY: test reproduce lab

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --upgrade pip
	# The CPU build of torch, pinned: a bare torch requirement would pull a multi-GB CUDA build.
	$(VENV)/bin/python -m pip install -q torch==2.13.0
	$(VENV)/bin/python -m pip install -q -e '.[test]'
	touch $(STAMP)

test: $(STAMP)
	$(VENV)/bin/python -m pytest -q

reproduce: $(STAMP)
	$(VENV)/bin/python -m xstage_lab reproduce --backend auto --out out

# The workbench: JupyterLab on the notebooks (run them top to bottom; `backend` picks live or replay).
lab: $(STAMP)
	$(VENV)/bin/jupyter lab notebooks/
