# Every target sets itself up on a fresh machine (Python 3.11, no GPU, no conda).
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)
# torch, pinned, from pip's index: the CPU build where that index holds one (a local wheel house,
# or the PyTorch CPU index set in pip's configuration). From PyPI on Linux pip takes the multi-GB
# CUDA build instead; there name the CPU index: make TORCH_INDEX=https://download.pytorch.org/whl/cpu
TORCH_INDEX ?=
# JupyterLab refuses to start as root without --allow-root: given where make runs as root.
LAB_ARGS ?= $(if $(filter 0,$(shell id -u)),--allow-root)

.PHONY: test reproduce lab

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --upgrade pip
	$(VENV)/bin/python -m pip install -q torch==2.13.0 $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(VENV)/bin/python -m pip install -q -e '.[test]'
	touch $(STAMP)

test: $(STAMP)
	$(VENV)/bin/python -m pytest -q

reproduce: $(STAMP)
	$(VENV)/bin/python -m xstage_lab reproduce --backend auto --out out

# The workbench: JupyterLab on the notebooks (run them top to bottom; `backend` picks live or replay).
lab: $(STAMP)
	$(VENV)/bin/jupyter lab $(LAB_ARGS) notebooks/
