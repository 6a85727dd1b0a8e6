"""Which checkpoint a run resumes from, and the one line when none can be (megarl/checkpoint/manager.py).
Real megatron checkpoints, damaged after their save: tests/dist/test_damaged_checkpoint.py."""
import pytest

from megarl.checkpoint import manager as ckpt
from megarl.config import ConfigError


def _complete(root, step):
    folder = root / f"step_{step}"
    folder.mkdir(parents=True)
    (folder / "COMPLETE").write_text(str(step))
    return folder


def test_newest_intact_is_taken_and_damaged_newer_ones_are_named(tmp_path, monkeypatch):
    for step in (1, 4, 9):
        _complete(tmp_path, step)
    broken = {"step_9": "actor/__0_0.distcp is missing", "step_4": "driver.pt does not load (EOFError)"}
    monkeypatch.setattr(ckpt, "checkpoint_problem", lambda p: broken.get(p.name))
    said = []
    assert ckpt.resume_point(tmp_path, said.append).name == "step_1"
    assert len(said) == 2
    assert "step_9 is damaged (actor/__0_0.distcp is missing): resuming from step_1" in said[0]
    assert "step_4 is damaged (driver.pt does not load (EOFError))" in said[1]


def test_no_checkpoint_starts_fresh_and_all_damaged_stops(tmp_path):
    assert ckpt.resume_point(tmp_path / "none") is None
    _complete(tmp_path, 2)   # COMPLETE, but nothing else: damaged
    with pytest.raises(ConfigError, match=r"checkpoint\.dir=.*every checkpoint is damaged \(step_2: "
                                          r"actor/metadata\.json is missing\): remove them to start over"):
        ckpt.resume_point(tmp_path)


def test_a_checkpoint_that_does_not_fit_the_models_is_one_line(tmp_path, monkeypatch):
    folder = _complete(tmp_path, 0)
    (folder / "actor").mkdir()

    def mismatch(model, where):
        raise RuntimeError("Error(s) in loading state_dict for GPTModel:\n\tsize mismatch for embedding")
    monkeypatch.setattr(ckpt, "load_trainable", mismatch)
    with pytest.raises(ConfigError, match=r"step_0/actor does not load into this run's actor \(RuntimeError: "
                                          r"Error\(s\) in loading state_dict for GPTModel:\): it was written "
                                          r"with another model") as e:
        ckpt.load(folder, object(), None)
    assert "\n" not in str(e.value)
    with pytest.raises(FileNotFoundError, match=r"has no critic/"):
        ckpt.load(folder, object(), object())


def test_a_dist_checkpoint_folder_is_checked_against_its_metadata(tmp_path):
    """torch_dist folders (checkpoints, model.megatron_path): every file .metadata points into
    is there and long enough; checked from the files alone, before any rank loads."""
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp

    from megarl import preflight
    folder = tmp_path / "dist"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # no process group: torch warns and saves as one rank
        dcp.save({"w": torch.randn(10, 4), "b": torch.zeros(3)}, checkpoint_id=str(folder))
    assert ckpt.dist_folder_problem(folder) is None
    preflight.check_megatron_files(str(folder))
    shard = next(folder.glob("*.distcp"))
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size - 10)
    assert "is cut short" in ckpt.dist_folder_problem(folder)
    shard.unlink()
    assert ckpt.dist_folder_problem(folder) == f"{shard.name} is missing"
    with pytest.raises(ConfigError, match=r"model\.megatron_path=.*: __0_0\.distcp is missing: convert it again"):
        preflight.check_megatron_files(str(folder))
    (folder / ".metadata").write_bytes(b"not a pickle")
    assert ckpt.dist_folder_problem(folder).startswith(".metadata does not load")
    (folder / ".metadata").unlink()
    assert ckpt.dist_folder_problem(folder) == ".metadata is missing"


# -- the components a checkpoint keeps (megarl/checkpoint/state.py) ---------------------------
class Counter:
    def __init__(self, value=0):
        self.value = value

    def state_dict(self):
        return {"value": self.value}

    def load_state_dict(self, state):
        self.value = state["value"]


def test_every_registered_component_is_saved_under_its_name_and_loaded_back():
    from megarl.checkpoint.state import StateRegistry
    saved = StateRegistry()
    saved.register("sampler", Counter(7))
    saved.register("extra", Counter(3))      # a component added in one place only
    driver = ckpt.driver_state(4, saved)
    assert driver == {"step": 4, "version": 5, "sampler": {"value": 7}, "extra": {"value": 3}}

    fresh = StateRegistry()
    sampler, extra = Counter(), Counter()
    fresh.register("sampler", sampler)
    fresh.register("extra", extra)
    assert ckpt.restore(driver, fresh) == 5
    assert (sampler.value, extra.value) == (7, 3)
    assert fresh.names() == ["sampler", "extra"] and "extra" in fresh


def test_a_checkpoint_written_before_an_optional_component_still_resumes():
    """driver.pt of an older run lacks the optional one (the rollout's carry): it keeps its
    fresh state; a required one missing fails as before (KeyError)."""
    from megarl.checkpoint.state import StateRegistry
    old = {"step": 1, "version": 2, "sampler": {"value": 9}}
    reg, sampler, rollout = StateRegistry(), Counter(), Counter(42)
    reg.register("sampler", sampler)
    reg.register("rollout", rollout, optional=True)
    reg.load_state_dict(old)
    assert (sampler.value, rollout.value) == (9, 42)
    reg.register("rng", Counter())
    with pytest.raises(KeyError, match="rng"):
        reg.load_state_dict(old)


def test_components_load_in_registration_order_and_names_are_unique():
    """The rollout, registered after the sampler, restores the sampler cursor of its own snapshot."""
    from megarl.checkpoint.state import StateRegistry
    shared = Counter()

    class Rollout:
        def state_dict(self):
            return {}

        def load_state_dict(self, state):
            shared.value = state["sampler"]

    reg = StateRegistry()
    reg.register("sampler", shared)
    reg.register("rollout", Rollout())
    reg.load_state_dict({"sampler": {"value": 1}, "rollout": {"sampler": 2}})
    assert shared.value == 2
    for name in ("sampler", "step", "version"):
        with pytest.raises(ValueError, match="registered twice"):
            reg.register(name, Counter())


def test_the_rng_component_restores_torch_and_python_generators():
    import random

    import torch

    from megarl.checkpoint.state import GlobalRNG
    rng = GlobalRNG()
    state = rng.state_dict()
    want = (torch.rand(3), random.random())
    rng.load_state_dict(state)
    assert torch.equal(torch.rand(3), want[0]) and random.random() == want[1]
