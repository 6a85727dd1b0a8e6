"""Bad inputs of a Mixture-of-Experts run, each refused in one line naming the setting or the
file and the fix, before anything is built or launched: an expert-parallel size that does not
divide the experts, a layout megatron cannot train, an HF checkpoint missing one expert's
tensor and an MoE option in config.json the mapping does not reproduce, both in the
converter (tools/convert_hf_to_megatron.py) and on the trainer's HF load path (preflight's
check of model.path). A layout not dividing the world: tests/unit/test_moe_config.py."""
from __future__ import annotations

import contextlib
import io
import json

import pytest
from safetensors.torch import load_file, save_file

from megarl.config import ConfigError, load_config
from megarl.config.schema import ParallelConfig

transformers = pytest.importorskip("transformers")
MISSING = "model.layers.1.mlp.experts.3.up_proj.weight"


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """The tiny Qwen3-MoE (4 experts) saved by transformers, and copies of it broken one way each."""
    from tools import tiny_archs
    root = tmp_path_factory.mktemp("moe_bad")
    good = root / "good"
    tiny_archs.make_model(0, "qwen3_moe").save_pretrained(good)
    out = {"good": good}
    for name in ("missing_expert", "n_group"):
        folder = root / name
        folder.mkdir()
        for f in good.iterdir():
            (folder / f.name).write_bytes(f.read_bytes())
        out[name] = folder
    weights = out["missing_expert"] / "model.safetensors"
    tensors = load_file(weights)
    del tensors[MISSING]
    save_file(tensors, weights, metadata={"format": "pt"})
    config = json.loads((out["n_group"] / "config.json").read_text())
    config["n_group"] = 2   # DeepSeek-V3's grouped top-k routing: not in the Qwen3-MoE table
    (out["n_group"] / "config.json").write_text(json.dumps(config))
    return out


def one_line(text: str) -> str:
    lines = text.strip().splitlines()
    assert len(lines) == 1, text
    return lines[0]


def convert(folders, tmp_path, name, *flags):
    from megarl.conversion.cli import cli_hf_to_megatron
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        rc = cli_hf_to_megatron(["--hf", str(folders[name]), "--out", str(tmp_path / "out"), "--no-progress",
                                 *flags])
    assert rc == 2, err.getvalue()
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())
    return one_line(err.getvalue())


@pytest.mark.parametrize("name,flags,expect", [
    ("missing_expert", [], rf"missing HF parameters.*{MISSING}"),
    ("n_group", [], r"Qwen3MoeForCausalLM with n_group=2 in config\.json is not supported"),
    ("good", ["--ep", "3"], r"--ep 3 must divide the model's 4 experts .*pick a divisor of 4"),
])
def test_converter_refuses_in_one_line(folders, tmp_path, name, flags, expect):
    import re
    line = convert(folders, tmp_path, name, *flags)
    assert line.startswith("convert_hf_to_megatron: error:") and re.search(expect, line), line


@pytest.mark.parametrize("name,expect", [
    ("missing_expert", rf"model\.path=.*missing_expert.*missing HF parameters.*{MISSING}.*copy the folder again"),
    ("n_group", r"model\.path=.*n_group=2 in config\.json is not supported"),
])
def test_trainer_hf_path_refuses_in_one_line(folders, name, expect):
    """What the trainer checks of model.path before the run directory is touched (and every
    rank again before loading): the same faults, named with the setting."""
    from megarl.preflight import check_weights_match
    with pytest.raises(ConfigError, match=expect) as err:
        check_weights_match(str(folders[name]), "model.path")
    one_line(str(err.value))


def hf(folders, name="good"):
    return transformers.AutoConfig.from_pretrained(folders[name])


@pytest.mark.parametrize("settings,expect", [
    (dict(ep=3), r"parallel\.ep=3: must divide the model's 4 experts.*pick a divisor of 4"),
    (dict(ep=8), r"parallel\.ep=8: must divide the model's 4 experts"),
    (dict(tp=2, ep=2), r"parallel\.sequence_parallel=False: must be true with parallel\.tp=2 on an MoE model"),
    (dict(ep=2, moe_dispatcher="allgather"),
     r"parallel\.moe_dispatcher='allgather'.*use parallel\.moe_dispatcher=alltoall"),
    (dict(pp=2, moe_dispatcher="allgather"), r"parallel\.moe_dispatcher='allgather'.*parallel\.pp=2"),
])
def test_trainer_layout_the_model_cannot_take_is_named(folders, settings, expect):
    """The trainer's layout against the checkpoint (models/moe_layout.py, run by build_all
    before megatron builds anything): a ConfigError, which the CLI prints as one line."""
    from megarl.models.moe_layout import check_moe_layout
    with pytest.raises(ConfigError, match=expect) as err:
        check_moe_layout(ParallelConfig(**settings), hf(folders))
    one_line(str(err.value))


@pytest.mark.parametrize("settings", [dict(ep=1), dict(ep=2), dict(ep=4), dict(tp=2, ep=2, sequence_parallel=True),
                                      dict(moe_dispatcher="allgather")])
def test_trainer_layouts_megatron_trains_pass(folders, settings):
    from megarl.models.moe_layout import check_moe_layout
    check_moe_layout(ParallelConfig(**settings), hf(folders))


def test_setup_moe_layout_runs_the_layout_check(folders):
    """models/setup.moe_layout (what build_all hands transformer_config) runs the check: a
    run whose layout does not fit the model stops there with the ConfigError."""
    from megarl.models.setup import moe_layout
    cfg = load_config(None, [f"model.path={folders['good']}", "algo.name=grpo", "parallel.ep=3"])
    with pytest.raises(ConfigError, match=r"parallel\.ep=3"):
        moe_layout(cfg, hf(folders))
    assert moe_layout(load_config(None, [f"model.path={folders['good']}", "algo.name=grpo", "parallel.ep=2"]),
                      hf(folders))["ep"] == 2


def test_dense_model_ignores_the_moe_layout(folders, tmp_path):
    """A dense checkpoint: the MoE settings are not checked against it (it has no experts)."""
    from megarl.models.moe_layout import check_moe_layout
    from tools import tiny_archs
    tiny_archs.make_model(0, "qwen3").save_pretrained(tmp_path / "dense")
    check_moe_layout(ParallelConfig(ep=3, tp=2), transformers.AutoConfig.from_pretrained(tmp_path / "dense"))
