"""LoRA layers split over TP=2 compute what one process computes on the full tensors, and a
tiny GPTModel with adapters gives the same logits at PP=2 as at PP=1 (real ranks on gloo,
lora_probe.py).

Tolerance (DEVELOPERS.md, "Numerical tolerances"; parity.Tol): each quantity's largest
|TP=2 - reference| relative to its largest |reference| value, at most 1e-5. Set from:
- noise: the reference recomputed in other reduction orders (the input dimension summed in two
  halves as the TP=2 row layer does; (B A) x for B (A x); 2 threads): at most 2.5e-7 of the
  largest value (A's gradient: 9.5e-6 of 38), measured on a 2-core AMD EPYC; the TP=2 layers
  themselves differ by as much (3.8e-6 of 38). The PP=2 logits came out bitwise equal.
- catch: one adapter shard on the wrong TP rank (rank 0's and rank 1's swapped): 1.2 of the
  largest output (column layer, B swapped) and 0.86 (row layer, A swapped), 1e5 tolerances.
The test asserts the tolerance is >= parity.NOISE_MARGIN x the noise each run measures, and
that the swapped shard fails by more than one tolerance."""
import json

import pytest
import torch
from conftest import run_py
from parity import NOISE_MARGIN, Tol

TOL = Tol(rel=1e-5, noise="2.5e-7 of the largest value (reordered fp32 reference; TP=2 itself 1e-7)",
          catch="an adapter shard on the wrong TP rank: 0.86 to 1.2 of the largest output")
QUANTITIES = ("out", "da", "db", "dx")    # the output, A's, B's and the input's gradients
REORDERED = ("ref_halves", "ref_assoc", "ref_threads2")


@pytest.fixture(scope="module")
def probe(tmp_path_factory):
    out = tmp_path_factory.mktemp("lora") / "lora.json"
    proc = run_py(["-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone",
                   "tests/dist/lora_probe.py", str(out)])
    assert proc.returncode == 0, proc.stderr[-6000:]
    return json.loads(out.read_text())


def error(got, ref) -> float:
    """The largest |got - ref| in units of the tolerance (relative to the largest |ref|)."""
    got, ref = torch.tensor(got), torch.tensor(ref)
    if got.shape != ref.shape:
        return float("inf")
    return (got - ref).abs().max().item() / TOL.allowed(ref.abs().max().item())


def errors(case: dict, ref: dict) -> dict[str, float]:
    return {f"{kind}.{q}": error(case[kind][q], ref[kind][q]) for kind in ("column", "row") for q in QUANTITIES}


def test_tp2_layers_equal_the_single_process_reference(probe):
    """Column (A replicated, B split) and row (A split, B replicated) layers at TP=2: the output
    and the adapters' and input's gradients, gathered, within the tolerance; what is replicated
    is bitwise the same on both ranks."""
    errs = errors(probe["tp2"], probe["ref"])
    assert all(v <= 1 for v in errs.values()), errs
    assert probe["tp2"]["column"]["replicas_agree"] and probe["tp2"]["row"]["replicas_agree"]


def test_a_swapped_adapter_shard_fails_the_same_check(probe):
    """Rank 0's shard of the split adapter on rank 1 and the other way round (column: B, row: A)
    fails the check above, for each layer, by far more than its tolerance."""
    errs = errors(probe["tp2_swapped"], probe["ref"])
    for kind in ("column", "row"):
        assert errs[f"{kind}.out"] > 1000, errs
        assert max(errs[f"{kind}.{q}"] for q in QUANTITIES) > 1000, errs


def test_tolerance_clears_the_noise_of_another_reduction_order(probe):
    noise = max(max(errors(probe[name], probe["ref"]).values()) for name in REORDERED)
    assert noise > 0, "the reordered references are bitwise equal: they measure no noise"
    assert noise * NOISE_MARGIN <= 1, f"noise {noise:.2g} of the tolerance, at most {1 / NOISE_MARGIN:g} allowed"


def test_pp2_gives_the_pp1_logits(probe):
    """A 2-layer GPTModel with adapters on every target and B set from the same seeded full
    tensors: the logits of its two stages equal the one-stage model's (A drawn by global layer
    number, so the same on either layout), and the adapters move them (B is non-zero)."""
    assert error(probe["pp2"], probe["pp1"]) <= 1
    assert error(probe["pp1_base"], probe["pp1"]) > 1000
