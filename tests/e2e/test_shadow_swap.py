"""A staged push's swap (rollout/weights/shadow.py) leaves a real vLLM engine exactly as vLLM's
own in-place reload of the same weights does, for a dense model with biases, one with per-head
query / key norms, and a Mixture-of-Experts model (whose CPU experts are repacked into their
kernel's layout: engines/moe_reload.py), and the live model computes with the old weights until
the swap."""
import json
import shutil

import pytest
from conftest import run_py

from tools import tiny_archs

FILES = ("tokenizer.json", "tokenizer_config.json", "tokenization_countdown.py")


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "qwen3_moe"])
def test_the_swap_equals_vllms_in_place_reload_bitwise(arch, tiny_model, tmp_path):
    folder = tiny_archs.save_untied(tmp_path / arch, arch)
    for f in FILES:
        shutil.copy(tiny_model / f, folder / f)
    out = tmp_path / "probe.json"
    proc = run_py(["tests/e2e/shadow_swap_probe.py", str(folder), str(out)], timeout=600)
    assert proc.returncode == 0, proc.stderr[-6000:]
    r = json.loads(out.read_text())
    assert r["mismatched"] == [] and r["tensors"] > 10 and r["swapped_layers"] > 5
    assert r["swapped"] == r["reloaded"]               # the same floats, token by token
    assert r["back"] == r["first"] and r["reloaded"] != r["first"]   # the weights did change
    assert r["live_during"] == r["first"]              # prepared beside it: the live model untouched
