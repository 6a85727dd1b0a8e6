"""The expert-parallel layout settings: parallel.ep and parallel.moe_dispatcher, and the world
check (ep divides the data-parallel ranks), each refusal one line naming the setting."""
import pytest

from megarl.config import ConfigError, load_config, validate_world


def cfg(*overrides):
    return load_config(None, ["algo.name=grpo", "train.groups_per_step=4", "rollout.sampling.n=2",
                              "train.micro_batch_size=1", *overrides])


@pytest.mark.parametrize("world,tp,pp,ep,dp", [(2, 1, 1, 2, 2), (4, 2, 1, 2, 2), (4, 1, 2, 2, 2),
                                               (8, 2, 1, 2, 4), (4, 1, 1, 4, 4)])
def test_ep_dividing_dp_is_accepted(world, tp, pp, ep, dp):
    assert validate_world(cfg(f"parallel.tp={tp}", f"parallel.pp={pp}", f"parallel.ep={ep}"), world) == dp


@pytest.mark.parametrize("world,tp,pp,ep", [(2, 2, 1, 2), (4, 1, 1, 3), (6, 2, 1, 2), (4, 2, 2, 2)])
def test_ep_not_dividing_dp_names_the_settings(world, tp, pp, ep):
    with pytest.raises(ConfigError) as err:
        validate_world(cfg(f"parallel.tp={tp}", f"parallel.pp={pp}", f"parallel.ep={ep}"), world)
    text = str(err.value)
    assert "parallel.ep" in text and f"dp={world // (tp * pp)}" in text and "\n" not in text.strip()
    assert f"launch a multiple of {tp * pp * ep} ranks" in text


@pytest.mark.parametrize("setting,value,fix", [("parallel.ep", 0, ">= 1"),
                                               ("parallel.moe_dispatcher", "flex", "alltoall")])
def test_bad_values_are_refused(setting, value, fix):
    with pytest.raises(ConfigError, match=rf"{setting}.*{fix}"):
        cfg(f"{setting}={value}")


def test_router_loss_defaults_follow_the_checkpoint():
    """moe.aux_loss_coeff < 0 (default) takes config.json's router_aux_loss_coef; a value given
    wins; load_balancing=none turns it off; a negative z-loss is refused naming the key."""
    class Hf:
        router_aux_loss_coef = 0.001
    assert cfg().moe.aux_coeff(Hf()) == 0.001
    assert cfg("moe.aux_loss_coeff=0.01").moe.aux_coeff(Hf()) == 0.01
    assert cfg("moe.load_balancing=none").moe.aux_coeff(Hf()) == 0.0
    with pytest.raises(ConfigError, match="moe.z_loss_coeff"):
        cfg("moe.z_loss_coeff=-1")
