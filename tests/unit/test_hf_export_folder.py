"""The Hugging Face export's schedule, atomic publishing and `megarl export`'s refusals
(megarl/checkpoint/hf_export.py; the export itself at TP=2 x PP=2: tests/dist/test_hf_export.py)."""
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from megarl.checkpoint import hf_export
from megarl.config import ConfigError, load_config
from megarl.formats.hf_reader import ConversionError


def folder(path: Path, **files: str) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (path / name).write_text(text)
    return path


@pytest.fixture
def recorded(monkeypatch):
    """export_actor and the copy onto final recorded, not run (no model here)."""
    calls = []
    monkeypatch.setattr(hf_export, "export_actor", lambda model, info, out, side, mb, step=None:
                        calls.append(("export", Path(out).name, step)) or Path(out))
    monkeypatch.setattr(hf_export, "_copy_export", lambda src, out: calls.append(("copy", src.name, out.name)) or out)
    return calls


@pytest.mark.parametrize("steps, expected", [
    (5, [("export", "step_1", 1), ("export", "step_3", 3), ("export", "final", 4)]),
    # the last step is on schedule: final is the same weights, linked, not gathered again
    (4, [("export", "step_1", 1), ("export", "step_3", 3), ("copy", "step_3", "final")]),
])
def test_schedule_counts_steps_as_checkpoints_do(recorded, tmp_path, steps, expected):
    cfg = load_config("recipes/tiny_cpu.yaml", [f"run.dir={tmp_path}", f"train.steps={steps}",
                                                "checkpoint.hf_every=2", "checkpoint.hf_final=true"])
    for step in range(steps):
        hf_export.after_step(cfg, step, actor=type("A", (), {"model": None, "info": None})())
    assert recorded == expected


def test_no_export_by_default(recorded, tmp_path):
    cfg = load_config("recipes/tiny_cpu.yaml", [f"run.dir={tmp_path}", "train.steps=2"])
    for step in range(2):
        hf_export.after_step(cfg, step, actor=None)
    assert recorded == []


@pytest.mark.parametrize("key, value", [("checkpoint.hf_every", -1), ("checkpoint.hf_shard_mb", 0)])
def test_bad_settings_are_one_line_errors(key, value):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config("recipes/tiny_cpu.yaml", [f"{key}={value}"])


@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2", "two_renames"])
def test_publish_replaces_a_previous_folder_whole(tmp_path, monkeypatch, exchange):
    """A new folder takes the name; an existing one is replaced (atomically exchanged where the
    kernel can, else renamed aside first); nothing else is left beside it."""
    swaps, real = [], hf_export._exchange
    monkeypatch.setattr(hf_export, "_exchange", lambda a, b: swaps.append(exchange and real(a, b)) or swaps[-1])
    out = tmp_path / "final"
    hf_export.publish(folder(tmp_path / ".tmp_final", a="1"), out)
    assert (out / "a").read_text() == "1" and swaps == []     # a new name: a plain rename
    hf_export.publish(folder(tmp_path / ".tmp_final", b="2"), out)
    if exchange and swaps != [True]:
        pytest.skip("this file system cannot exchange two paths (renameat2 RENAME_EXCHANGE)")
    assert swaps == [exchange]
    assert sorted(p.name for p in out.iterdir()) == ["b"]
    assert [p.name for p in tmp_path.iterdir()] == ["final"]


def shard(path: Path, names: list[str]) -> tuple[str, list[str], int]:
    save_file({n: torch.zeros(2, 3) for n in names}, str(path))
    return path.name, names, 24 * len(names)


def test_finish_names_shards_and_publishes(tmp_path, tiny_model):
    tmp, out = tmp_path / ".tmp_hf", tmp_path / "hf"
    tmp.mkdir()
    stage0 = [shard(tmp / "stage000-00000.safetensors", ["a", "b"]), shard(tmp / "stage000-00001.safetensors", ["c"])]
    stage1 = [shard(tmp / "stage001-00000.safetensors", ["d"])]
    gathered = [((1, stage1), None), ((0, stage0), None), ((0, []), None)]   # ranks in any order
    assert hf_export._finish(tmp, out, gathered, tiny_model, {"step": 3}) is None
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert index["weight_map"] == {"a": "model-00001-of-00003.safetensors", "b": "model-00001-of-00003.safetensors",
                                   "c": "model-00002-of-00003.safetensors", "d": "model-00003-of-00003.safetensors"}
    assert index["metadata"]["total_size"] == 96
    assert json.loads((out / "config.json").read_text())["dtype"] == "float32"
    assert json.loads((out / "megarl_export.json").read_text())["step"] == 3
    assert not tmp.exists()


def test_a_failed_export_leaves_the_previous_one(tmp_path, tiny_model):
    """A stage's write error, or side files that cannot be copied: the problem is returned,
    the temporary folder removed, the previous export of the name untouched."""
    out = folder(tmp_path / "hf", marker="previous")
    tmp = folder(tmp_path / ".tmp_hf")
    problem = hf_export._finish(tmp, out, [((0, []), "stage 1: [Errno 28] No space left on device")],
                                tiny_model, {"step": 0})
    assert "No space left" in problem and not tmp.exists()
    tmp = folder(tmp_path / ".tmp_hf")
    written = shard(tmp / "stage000-00000.safetensors", ["a"])
    problem = hf_export._finish(tmp, out, [((0, [written]), None)], tmp_path / "missing", {"step": 0})
    assert "missing" in problem and not tmp.exists()
    assert [p.name for p in out.iterdir()] == ["marker"]


def test_generation_config_is_made_when_the_model_has_none(tmp_path, tiny_model):
    side = tmp_path / "side"
    side.mkdir()
    (side / "config.json").write_text((tiny_model / "config.json").read_text())
    out = folder(tmp_path / "out")
    hf_export.finish_side_files(out, side, "BF16", {"step": 0})
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    gen = json.loads((out / "generation_config.json").read_text())
    assert gen["eos_token_id"] == 2 and gen["bos_token_id"] == 1


def test_export_command_refuses_bad_input(tmp_path):
    run = folder(tmp_path / "run")
    (run / "checkpoints").mkdir()
    with pytest.raises(ConversionError, match="does not exist"):
        hf_export.export_checkpoint(str(tmp_path / "nope"), None, str(tmp_path / "o1"))
    with pytest.raises(ConversionError, match="no complete checkpoint under"):
        hf_export.export_checkpoint(str(run), None, str(tmp_path / "o2"))
    folder(run / "checkpoints" / "step_4", COMPLETE="4")
    with pytest.raises(ConversionError, match=r"--step 2: no complete checkpoint .*complete ones: step_4"):
        hf_export.export_checkpoint(str(run), 2, str(tmp_path / "o3"))
    with pytest.raises(ConversionError, match="already exists"):
        hf_export.export_checkpoint(str(run), None, str(folder(tmp_path / "o4", x="1")))
    assert not any((tmp_path / f"o{i}").exists() for i in (1, 2, 3))


def test_export_command_errors_are_one_line(tmp_path, capsys, monkeypatch):
    """`megarl export`: a missing run directory, an existing --out, a missing step: exit 2 and
    one line naming it; nothing written."""
    from megarl import cli
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")   # main hides the GPUs; restored after the test
    run = folder(tmp_path / "run")
    folder(run / "checkpoints" / "step_4", COMPLETE="4")
    cases = (([str(tmp_path / "nope"), "--out", str(tmp_path / "o1")], "run directory", "does not exist"),
             ([str(run), "--out", str(folder(tmp_path / "o2", x="1"))], "--out", "already exists"),
             ([str(run), "--step", "2", "--out", str(tmp_path / "o3")], "--step 2", "complete ones: step_4"))
    for args, first, second in cases:
        assert cli.main(["export", *args]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("megarl export: error:"), err
        assert first in err[0] and second in err[0], err
    assert not (tmp_path / "o1").exists() and not (tmp_path / "o3").exists()


def test_a_killed_exports_leftover_is_replaced(tmp_path):
    """What an export killed mid-way leaves (`.tmp_final`, half written) is never read as an
    export and is removed by the next one; the final name only ever holds a whole folder."""
    src = folder(tmp_path / "step_3", **{"model-00001-of-00001.safetensors": "w", "config.json": "{}"})
    folder(tmp_path / ".tmp_final", **{"model-00001-of-00002.safetensors": "half"})
    out = hf_export._copy_export(src, tmp_path / "final")
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model-00001-of-00001.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["final", "step_3"]


def test_an_export_is_readable_as_megarl_exports_are(tmp_path):
    """safetensors writes its files 0600; a published export's files have the mode any file
    written here gets (0644 under umask 022), as `megarl export`'s, in-run exports included."""
    import os
    import stat
    tmp = folder(tmp_path / ".tmp_step_3", **{"config.json": "{}"})
    save_file({"w": torch.zeros(2)}, str(tmp / "model-00001-of-00001.safetensors"))
    assert stat.S_IMODE(os.stat(tmp / "model-00001-of-00001.safetensors").st_mode) == 0o600
    hf_export.publish(tmp, tmp_path / "step_3")
    umask = os.umask(0)
    os.umask(umask)
    for f in (tmp_path / "step_3").iterdir():
        assert stat.S_IMODE(f.stat().st_mode) == 0o666 & ~umask, f.name
