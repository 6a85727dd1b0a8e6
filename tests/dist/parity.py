"""How close a run of layout_probe.py at another layout (or micro-batch size, or resumed from a
checkpoint) must come to the single-rank reference run, and why.

Every tolerance sits between two measured figures (fp32, the tiny model, 3 PPO steps of 2 Adam
updates each, on a 2-core AMD EPYC; tools/parity_margins.py measures them again on any machine,
and each Tol below keeps the figures it was set from):
- noise: what the reduction order alone moves the quantity by. Measured by repeating the
  reference with its order changed on purpose: 2 threads instead of 1, micro-batches of 1 and 2
  rows instead of 4, MKL's generic code path (MKL_CBWR=COMPATIBLE) and ATen without AVX
  (ATEN_CPU_CAPABILITY=default); these stand in for another processor's path through the
  libraries. The TP=2 / PP=2 / DP=2 layouts themselves differ from the reference by as much.
- catch: the smallest real error the comparison exists for. Two rows of one TP shard swapped
  (a wrong shard, resharding or name mapping), and every update 1% too large (actor_lr or
  critic_lr x1.01: a wrong normaliser, learning rate or Adam step count).
A tolerance is at least 5x the noise (test_layouts.py asserts it for the noise each run
measures, so a machine where it is not fails there, naming the quantity, instead of failing a
layout test at random) and below the smallest catch.

Why the post-update logprobs get their own, wider tolerance: Adam moves each weight by about
+-lr per update whatever its gradient's size, so an element whose gradient is near 0 takes
the sign fp32 rounding gives it, and a model that moves its logprobs by nats in 3 steps (this
one does, on its one fixed batch) carries that noise into every logprob, about 2x more each
step: 1e-5 to 2e-5 here after 3 steps, up to 8e-5 reported at TP=2 on another 2-core machine.
An update 1% too large moves them by 3e-2 after one step. Losses and gradient norms barely
see that noise (the loss's gradient along those elements is ~0), and the logprobs before any
update (`logp_start`) see none of it, so those stay tight; the wrong shard shows in all of them.
(megatron's distributed optimizer takes Adam only, so the probe cannot switch to plain SGD;
a larger Adam eps, which bounds how much an update can amplify gradient noise, measured no
better here.)
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Tol:
    """|got - ref| <= max(abs, rel * |ref|). `noise` and `catch`: the figures it was set from."""
    abs: float = 0.0
    rel: float = 0.0
    noise: str = ""
    catch: str = ""

    def allowed(self, ref: float) -> float:
        return max(self.abs, self.rel * abs(ref))


TOLERANCES = {
    # a sum of +- terms that nearly cancel (~0.04 from terms of ~0.1-1): absolute
    "policy_loss": Tol(abs=1e-5, noise="2.5e-7 absolute (ATen without AVX; TP=2: 1.6e-7)",
                       catch="critic_lr x1.01: 1.7e-5 (through the advantages); actor_lr x1.01: 5.9e-4; "
                             "a swapped shard: 2.8e-3"),
    "value_loss": Tol(rel=1e-5, noise="6.4e-8 relative",
                      catch="critic_lr x1.01: 2.1e-3 relative; a swapped shard: 7.2e-4"),
    "grad_norm": Tol(rel=5e-5, noise="1.9e-6 relative (MKL's generic path; 2.7e-6 in other runs)",
                     catch="actor_lr x1.01: 3e-3 relative; a swapped shard: 3.4e-2"),
    "critic_grad_norm": Tol(rel=5e-5, noise="5.8e-8 relative",
                            catch="critic_lr x1.01: 8.1e-4 relative; a swapped shard: 1.4e-3"),
    # the actor's logprobs at the weights the run starts from (a forward pass, no update): as
    # the forward parity tests against transformers (test_model_families, compare_logits)
    "logp_start": Tol(abs=1e-4, noise="5.7e-6 absolute (MKL's generic path; TP=2: 3.8e-6)",
                      catch="a swapped shard: 0.41"),
    # after each step's updates (see the module docstring)
    "logp": Tol(abs=1e-3, noise="1.1e-5 to 2e-5 absolute after 3 steps here, 8e-5 on another x86 machine",
                catch="actor_lr x1.01: 3.1e-2 after one step, 9.4e-2 after three; critic_lr x1.01: 3.7e-3; "
                      "a swapped shard: 1.6"),
}
#: the least ratio of a tolerance to the noise each run measures
NOISE_MARGIN = 5.0
#: the reference again in other reduction orders: what fp32 noise alone moves (2 threads;
#: micro-batches of 1 and 2 rows instead of 4)
REORDERED = {"threads2": ["threads=2"], "mbs1": ["train.micro_batch_size=1"], "mbs2": ["train.micro_batch_size=2"]}
#: a deliberately wrong TP shard (at TP=2): two rows of rank 1's part of the first MLP's input weight
SWAP = "swap_rows=decoder.layers.0.mlp.linear_fc1.weight"
SCALARS = ("policy_loss", "value_loss", "grad_norm", "critic_grad_norm")


def error(key: str, got, ref) -> float:
    """The largest |got - ref| of `key` in units of its tolerance (<= 1: within it); values
    may be numbers or equal-length lists (logprobs)."""
    tol = TOLERANCES[key]
    if isinstance(ref, list):
        if len(got) != len(ref):
            return float("inf")
        return max((abs(g - r) / tol.allowed(r) for g, r in zip(got, ref)), default=0.0)
    return abs(got - ref) / tol.allowed(ref)


def errors(got: list[dict], ref: list[dict]) -> dict[str, float]:
    """Per quantity, the largest error (in tolerances) over the steps of two histories; a
    quantity the reference lacks in a step is skipped (`logp_start` is in a run's first step
    only), one it has and `got` lacks is off by inf (a probe that stopped reporting it)."""
    if len(got) != len(ref):
        raise AssertionError(f"{len(got)} steps against {len(ref)}")
    out: dict[str, float] = {}
    for x, y in zip(got, ref):
        for key in TOLERANCES:
            if key in y:
                err = error(key, x[key], y[key]) if key in x else float("inf")
                out[key] = max(out.get(key, 0.0), err)
    return out


def assert_parity(got: list[dict], ref: list[dict], what: str = "") -> dict[str, float]:
    """Every quantity within its tolerance; the message names each one that is not, by how
    many tolerances, with the figures the tolerance was set from."""
    errs = errors(got, ref)
    bad = {k: v for k, v in errs.items() if not v <= 1.0}
    assert not bad, f"{what}: " + "; ".join(
        f"{k} off by {v:.3g}x its tolerance (noise measured: {TOLERANCES[k].noise}; "
        f"it exists to catch {TOLERANCES[k].catch})" for k, v in bad.items())
    return errs
