"""The trainer's top-k / top-p cut (models/sampling_cut.py) and the logprobs renormalised over it
(models/logprobs.py at TP=1), against direct references: vLLM's own masking function from the
venv, and a per-row sort and cumulative sum written out here."""
import json
import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from conftest import ROOT
from test_moe_mapping import megatron_world  # noqa: F401  (the one-rank gloo world)

from megarl.distributed.env import free_port
from megarl.models import logprobs as lp
from megarl.models.sampling_cut import NO_CUT, Cut, kept_threshold

CUTS = [Cut(top_k=5), Cut(top_k=20), Cut(top_p=0.7), Cut(top_p=0.95), Cut(top_k=20, top_p=0.7),
        Cut(top_k=50, top_p=0.95), Cut(top_k=1), Cut(top_p=0.01), Cut(top_k=300), Cut(top_k=3, top_p=0.999)]


def reference_kept(z: torch.Tensor, cut: Cut) -> torch.Tensor:
    """[N, V] bool: per row, sorted ascending (a stable sort: ties in vocabulary order), the top-k
    rows' k-th value a threshold, then the cumulative mass of the top-k set renormalised, a
    token dropped while that sum (it and every token below it) is <= 1 - top_p, the likeliest
    always kept; vLLM's convention, one row at a time."""
    out = torch.zeros_like(z, dtype=torch.bool)
    one_minus_p = 1 - torch.tensor(cut.top_p, dtype=torch.float32)
    for i, row in enumerate(z):
        vals, idx = torch.sort(row, stable=True)
        keep = torch.ones_like(vals, dtype=torch.bool)
        if cut.top_k > 0:
            keep &= vals >= vals[len(vals) - min(cut.top_k, len(vals))]
        if cut.top_p < 1.0:
            mass = torch.where(keep, vals, torch.tensor(float("-inf"))).softmax(-1)
            total = torch.zeros(())
            for j in range(len(vals)):
                total = total + mass[j]
                if total <= one_minus_p and j < len(vals) - 1:
                    keep[j] = False
        out[i, idx] = keep
    return out


def logits(n=12, v=97, seed=0, scale=3.0):
    return torch.randn(n, v, generator=torch.Generator().manual_seed(seed)) * scale


@pytest.mark.parametrize("cut", CUTS, ids=str)
def test_threshold_keeps_the_references_set(cut):
    z = logits()
    kept = z >= kept_threshold(z, cut).unsqueeze(-1)
    assert torch.equal(kept, reference_kept(z, cut))
    if cut.top_k > 0:
        assert (kept.sum(-1) <= cut.top_k).all()
    assert kept.any(-1).all()


@pytest.mark.parametrize("cut", CUTS, ids=str)
def test_threshold_keeps_vllms_set(cut):
    """vLLM's own masking (the function its CPU sampler runs): the same kept set."""
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch
    z = logits(seed=3)
    k = torch.full((z.shape[0],), cut.top_k, dtype=torch.long) if cut.top_k > 0 else None
    p = torch.full((z.shape[0],), cut.top_p, dtype=torch.float32) if cut.top_p < 1 else None
    if k is not None:
        k = k.clamp(max=z.shape[1])
    theirs = apply_top_k_top_p_pytorch(z.clone(), k, p, allow_cpu_sync=True) > float("-inf")
    assert torch.equal(z >= kept_threshold(z, cut).unsqueeze(-1), theirs)


def test_ties_at_the_boundary():
    """Ties at the k-th value are all kept (vLLM compares values); a tie at the nucleus'
    boundary keeps every tied token, a superset of a sort-position split by the tied ones only."""
    z = torch.tensor([[4.0, 2.0, 2.0, 2.0, 1.0, 0.0, -1.0],
                      [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]])
    kept = z >= kept_threshold(z, Cut(top_k=2)).unsqueeze(-1)
    assert kept.tolist() == [[True, True, True, True, False, False, False], [True] * 7]
    assert torch.equal(kept, reference_kept(z, Cut(top_k=2)))
    for cut in (Cut(top_p=0.5), Cut(top_p=0.9), Cut(top_k=3, top_p=0.6)):
        t = kept_threshold(z, cut).unsqueeze(-1)
        ours, ref = z >= t, reference_kept(z, cut)
        assert (ours | ~ref).all(), cut              # every token the reference keeps
        assert ((ours == ref) | (z == t)).all(), cut  # differing only on tokens tied with the threshold
    # the uniform row at top_p=0.5: the reference keeps 4 of the 7 tied tokens, the threshold all
    assert reference_kept(z, Cut(top_p=0.5))[1].sum() == 4


def test_ties_in_random_logits():
    """Logits on a coarse grid (many exact ties), top-k and top-p together: as the reference
    except tokens tied with the threshold."""
    z = torch.randint(-6, 6, (40, 64), generator=torch.Generator().manual_seed(5)).float() / 2
    for cut in (Cut(top_k=7), Cut(top_p=0.8), Cut(top_k=10, top_p=0.6)):
        t = kept_threshold(z, cut).unsqueeze(-1)
        ours, ref = z >= t, reference_kept(z, cut)
        assert (ours | ~ref).all() and ((ours == ref) | (z == t)).all(), cut
        if cut.top_p == 1.0:
            assert torch.equal(ours, ref)


def renormalised(z, labels, cut):
    """The sampled tokens' logprobs of softmax(z) over the reference's kept set."""
    kept = reference_kept(z, cut)
    return (z.gather(-1, labels[:, None])[:, 0] - torch.where(kept, z, -math.inf).logsumexp(-1))


@pytest.mark.parametrize("cut", [Cut(top_k=20), Cut(top_p=0.7), Cut(top_k=20, top_p=0.9)], ids=str)
@pytest.mark.usefixtures("megatron_world")
def test_logprobs_renormalise_over_the_kept_set(cut):
    """vocab_parallel_logprobs at TP=1 with vocab padding and a temperature: the sampled token's
    logprob over the kept set renormalised; the entropy is the whole distribution's; a wrong
    renormalisation (over the whole vocabulary, or the top-k set ignoring top-p) differs."""
    T, true_vocab = 0.7, 90
    raw = logits(n=16, v=96, seed=7)                # 6 padding columns
    z = raw[:, :true_vocab] / T
    kept = reference_kept(z, cut)
    # sampled tokens: inside the kept set, as the engine's are
    labels = torch.multinomial(torch.where(kept, z, -math.inf).softmax(-1), 1,
                               generator=torch.Generator().manual_seed(1))[:, 0]
    report = {}
    got, entropy = lp.vocab_parallel_logprobs(raw[None], labels[None], true_vocab, True, T, cut, report)
    want = renormalised(z, labels, cut)
    assert (got[0] - want).abs().max() < 1e-5
    assert not report["cut_outside"].any()
    full = z.log_softmax(-1)
    assert (entropy[0] - -(full.exp() * full).sum(-1)).abs().max() < 1e-5
    wrong = {"no renormalisation": full.gather(-1, labels[:, None])[:, 0]}
    if cut.top_k > 0 and cut.top_p < 1:
        wrong["top-k only"] = renormalised(z, labels, Cut(top_k=cut.top_k))
    for name, w in wrong.items():
        assert (w - want).abs().max() > 1e-4, name


@pytest.mark.usefixtures("megatron_world")
def test_no_cut_is_the_plain_log_softmax():
    raw = logits(n=8, v=64, seed=2)
    labels = torch.arange(8) * 5
    got, _ = lp.vocab_parallel_logprobs(raw[None], labels[None], 64, True, 1.0, NO_CUT, report := {})
    assert (got[0] - raw.log_softmax(-1).gather(-1, labels[:, None])[:, 0]).abs().max() < 1e-6
    assert report == {}


@pytest.mark.usefixtures("megatron_world")
def test_a_label_outside_the_cut_gets_the_set_with_it_and_is_counted():
    """The engine only samples inside its set; a token the trainer's cut leaves out (rounding at
    the boundary) is given its logprob over the kept set plus itself, never -inf."""
    z = torch.tensor([[3.0, 2.0, 1.0, 0.5, 0.0]])
    labels = torch.tensor([[3]])        # outside top_k=2
    report = {}
    got, _ = lp.vocab_parallel_logprobs(z[None], labels[None][0], 5, False, 1.0, Cut(top_k=2), report)
    want = 0.5 - torch.tensor([3.0, 2.0, 0.5]).logsumexp(0)
    assert abs(float(got) - float(want)) < 1e-6
    assert report["cut_outside"].tolist() == [[True]]


@pytest.mark.usefixtures("megatron_world")
def test_chunked_threshold_search(monkeypatch):
    """The rows are searched in chunks of GATHER_ELEMENTS values: the same thresholds."""
    z = logits(n=30, v=50, seed=9)[None]
    whole = lp._kept_threshold(z, 50, Cut(top_k=10, top_p=0.8))
    monkeypatch.setattr(lp, "GATHER_ELEMENTS", 50 * 4)
    assert torch.equal(lp._kept_threshold(z, 50, Cut(top_k=10, top_p=0.8)), whole)


_TP2_RANK = textwrap.dedent("""
    import json, sys, torch, torch.distributed as dist
    from megarl.bootstrap import bootstrap
    bootstrap()
    from megarl.distributed import parallel
    from megarl.models import logprobs as lp
    from megarl.models.sampling_cut import Cut
    rank = int(sys.argv[1])
    dist.init_process_group("gloo", rank=rank, world_size=2)
    parallel.initialize(2, 1, 0)
    true_vocab, T = 120, 0.7                        # 128 columns: 8 of padding on rank 1
    full = torch.randn(2, 6, 128, generator=torch.Generator().manual_seed(4)) * 3
    labels = torch.randint(0, true_vocab, (2, 6), generator=torch.Generator().manual_seed(5))
    lp.GATHER_ELEMENTS = 3 * 128                    # several chunks of rows
    out = {}
    for cut in (Cut(top_k=20), Cut(top_p=0.7), Cut(top_k=20, top_p=0.9)):
        z = full[..., :true_vocab] / T
        kept = z >= lp.kept_threshold(z.reshape(-1, true_vocab), cut).reshape(2, 6, 1)
        kept |= torch.nn.functional.one_hot(labels, true_vocab).bool()   # a label outside: kept, counted
        ref_in = full.clone().requires_grad_(True)
        zr = ref_in[..., :true_vocab] / T
        ref = zr.gather(-1, labels[..., None])[..., 0] - zr.masked_fill(~kept, float("-inf")).logsumexp(-1)
        ref.sum().backward()
        part = full[..., 64 * rank: 64 * (rank + 1)].clone().requires_grad_(True)
        report = {}
        logp, _ = lp.vocab_parallel_logprobs(part, labels, true_vocab, True, T, cut, report)
        logp.sum().backward()
        out[str(cut)] = {"logp": float((logp - ref).abs().max()),
                         "grad": float((part.grad - ref_in.grad[..., 64 * rank: 64 * (rank + 1)]).abs().max()),
                         "outside": int(report["cut_outside"].sum())}
    print(json.dumps(out))
    parallel.destroy()
    dist.destroy_process_group()
""")


def test_tensor_parallel_cut_is_the_whole_vocabularys():
    """At TP=2 (2 gloo ranks, each a vocabulary slice, padding on the last) the cut's threshold
    is the whole vocabulary's (gathered in several chunks), so the logprobs and their gradient
    on each slice equal a one-process computation over the whole vocabulary. Two light ranks:
    no model, a few small tensors."""
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "PYTHONPATH": str(ROOT)}
    procs = [subprocess.Popen([sys.executable, "-c", _TP2_RANK, str(r)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-3000:] for o in outs]
    results = [json.loads(o[0].strip().splitlines()[-1]) for o in outs]
    for r in results:
        assert len(r) == 3
        for cut, v in r.items():
            assert v["logp"] < 1e-5 and v["grad"] < 1e-6, (cut, v)
    assert results[0] == results[1] or all(results[0][c]["outside"] == results[1][c]["outside"] for c in results[0])
    assert any(v["outside"] > 0 for v in results[0].values())   # random labels: some outside every cut


def test_requests_carry_the_cut_to_the_engines():
    """rollout.sampling.top_k / top_p reach every request of a round, vLLM's SamplingParams and
    the servers' request body; a continuation after an abort keeps them (pool.py)."""
    from megarl.rollout.controller.sync_rollout import group_requests
    from megarl.rollout.engines.http_stream import StreamedRequests
    from megarl.rollout.engines.vllm_async import sampling_params
    reqs = group_requests([[1, 2], [3]], 2, 8, 0.7, [5, 6], top_p=0.9, top_k=20)
    assert len(reqs) == 4 and all((r.top_p, r.top_k) == (0.9, 20) for r in reqs)
    params = sampling_params(reqs[0])
    assert (params.top_p, params.top_k) == (0.9, 20)
    body = StreamedRequests._payload(type("S", (), {"model": "m"})(), reqs[0])
    assert (body["top_p"], body["top_k"]) == (0.9, 20)
    off = group_requests([[1]], 1, 8, 0.7, None)[0]
    assert (off.top_p, off.top_k) == (1.0, -1) and sampling_params(off).top_p == 1.0


def test_the_service_samples_at_the_runs_cut_only():
    """An agent's chat request may repeat the run's top_p / top_k, or leave them out; another
    value is refused (400) naming the run's, as for the temperature."""
    from megarl.service.app import chat_options
    from megarl.service.recorder import ServiceError
    assert chat_options({"top_p": 0.9, "top_k": 20}, 1.0, 0.9, 20) == (None, False)
    assert chat_options({"top_k": 0}, 1.0) == (None, False)          # vLLM's "off" at a run without top_k
    for body, words in (({"top_p": 0.95}, "run's top_p=0.9 "), ({"top_k": 50}, "run's top_k=20 "),
                        ({"top_p": 1.0}, "run's top_p=0.9 ")):
        with pytest.raises(ServiceError, match=words):
            chat_options(body, 1.0, 0.9, 20)
