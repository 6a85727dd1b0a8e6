"""The per-step speed figures' maths (megarl/metrics/speed.py): FLOPs per real token of the
step's trainer passes, the GPU peak lookup and the tokens-per-second figures."""
from types import SimpleNamespace

import pytest

from megarl.metrics.speed import peak_flops, real_tokens, throughput, train_flops_per_token


def _cfg(name: str, epochs: int, kl_coef: float, rank: int = 0, critic: bool = False):
    return SimpleNamespace(train=SimpleNamespace(ppo_epochs=epochs),
                           algo=SimpleNamespace(name=name, uses_reference=kl_coef != 0),
                           model=SimpleNamespace(lora=SimpleNamespace(rank=rank, critic=critic)))


@pytest.mark.parametrize("name, epochs, kl, per_n", [
    ("grpo", 1, 0.0, 2 + 6),                       # old logprobs + actor update
    ("grpo", 2, 0.1, 2 + 12 + 2),                  # + a second epoch + the reference
    ("ppo", 1, 0.0, 2 + 6 + 2 + 6),                # + values + critic update
    ("ppo", 3, 0.1, 2 + 18 + 2 + 2 + 18),
])
def test_flops_per_token_count_each_pass(name, epochs, kl, per_n):
    assert train_flops_per_token(_cfg(name, epochs, kl), 1000) == per_n * 1000


def test_critic_warmup_trains_no_actor():
    assert train_flops_per_token(_cfg("ppo", 2, 0.0), 10, train_actor=False) == (2 + 2 + 12) * 10


@pytest.mark.parametrize("critic, critic_update", [(False, 6 * 1000), (True, 4 * 1000 + 6 * 10)])
def test_lora_updates_count_no_weight_gradients_of_the_frozen_base(critic, critic_update):
    # 1000 parameters, 10 of them adapters: the actor's update is 4N + 6 x adapters; the critic's
    # the same with model.lora.critic, else a full 6N; forward-only passes stay 2N
    cfg = _cfg("ppo", 1, 0.1, rank=4, critic=critic)
    assert train_flops_per_token(cfg, 1000, adapters=10) == 2 * 1000 + (4 * 1000 + 6 * 10) + 2 * 1000 \
        + 2 * 1000 + critic_update
    assert train_flops_per_token(_cfg("ppo", 1, 0.1), 1000, adapters=10) == (2 + 6 + 2 + 2 + 6) * 1000


def test_peak_lookup_prefers_the_longest_name():
    assert peak_flops("NVIDIA GH200 480GB") == peak_flops("NVIDIA H200") == 989e12
    assert peak_flops("NVIDIA A100-SXM4-80GB") == 312e12
    assert peak_flops("NVIDIA B200") == 2250e12
    assert peak_flops("Tesla T4") is None


def test_throughput_prefers_the_rounds_generated_tokens():
    samples = [SimpleNamespace(prompt_ids=[1, 2, 3], response_ids=[4] * 5),
               SimpleNamespace(prompt_ids=[1], response_ids=[4] * 7)]
    assert real_tokens(samples) == 16
    out = throughput(samples, {}, rollout_s=2.0, train_s=4.0, tokens=real_tokens(samples))
    assert out == {"rollout_tokens_per_s": 6.0, "train_tokens_per_s": 4.0}
    # partial rollout: the round generated carried samples' tokens too
    assert throughput(samples, {"rollout_tokens": 30}, 2.0, 4.0, 16)["rollout_tokens_per_s"] == 15.0
