# Every target sets itself up on a fresh machine (Python 3.11, no GPU, no conda).
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)
# torch, pinned, from pip's index: the CPU build where that index holds one (a local wheel house,
# or the PyTorch CPU index set in pip's configuration). From PyPI on Linux pip takes the multi-GB
# CUDA build instead; there name the CPU index: make TORCH_INDEX=https://download.pytorch.org/whl/cpu
TORCH_INDEX ?=
# reproduce's backend, per experiment and link: auto (live what this machine's links are for),
# cuda (live what it can run) or replay.
BACKEND ?= auto
# JupyterLab refuses to start as root without --allow-root: given where make runs as root.
LAB_ARGS ?= $(if $(filter 0,$(shell id -u)),--allow-root)

# pip installs without compiling (--no-compile): byte-compiling every file of torch, triton,
# plotly and jupyter took as long as the rest of the install, and a run imports a fraction of
# them. Python writes the bytecode of what it imports instead, unless PYTHONDONTWRITEBYTECODE
# is set, so it is kept from the commands here.
unexport PYTHONDONTWRITEBYTECODE

.PHONY: test reproduce lab

# A current pip first: the pip 23.2 that Python 3.11's venv brings took 10-20 s longer to resolve
# and install the same packages (about 60 s against 45 on the 2-core CI machine). torch is then
# installed with the package in one pip run (one resolution), or first and alone where TORCH_INDEX
# names its index.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --no-compile 'pip>=25'
ifneq ($(TORCH_INDEX),)
	$(VENV)/bin/python -m pip install -q --no-compile torch==2.13.0 --index-url $(TORCH_INDEX)
	$(VENV)/bin/python -m pip install -q --no-compile -e '.[test]'
else
	$(VENV)/bin/python -m pip install -q --no-compile torch==2.13.0 -e '.[test]'
endif
	touch $(STAMP)

# In parallel (pytest-xdist, one worker per core); tests/conftest.py groups the tests that share
# a fixture wider than one test onto one worker.
test: $(STAMP)
	$(VENV)/bin/python -m pytest -q -n auto --dist loadgroup

reproduce: $(STAMP)
	$(VENV)/bin/python -m xstage_lab reproduce --backend $(BACKEND) --out out

# The workbench: JupyterLab on the notebooks (run them top to bottom; `backend` picks live or replay).
lab: $(STAMP)
	$(VENV)/bin/jupyter lab $(LAB_ARGS) notebooks/
