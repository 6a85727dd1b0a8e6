"""Routing replay's layout maths (megarl/ppo/route_layout.py) and its refusals: the engine's
routes padded into the batch, cut per micro-batch into the router's sequence-major order, the
sequence-parallel part, a pipeline stage's MoE layers; a dense model refuses replay."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from megarl.data.sample import Sample
from megarl.formats.experts import sparse_layer_indices
from megarl.ppo import route_layout as layout
from megarl.ppo.batch import build_batch


def coded(rows: int, length: int, layers: int = 2, topk: int = 2, experts: int = 64) -> np.ndarray:
    """Routes whose ids encode (row, position, layer, slot): any misplaced entry shows."""
    r, s, j, k = np.meshgrid(range(rows), range(length), range(layers), range(topk), indexing="ij")
    return ((r * 17 + s * 5 + j * 3 + k) % experts).astype(np.uint8)


def sample(prompt: int, response: int, routes=None) -> Sample:
    return Sample([1] * prompt, [2] * response, [0.0] * response, [0] * response, True, 0, routes=routes)


def test_batch_routes_pad_rows_and_the_last_token_with_valid_experts():
    samples = [sample(3, 4), sample(2, 1)]
    for i, s in enumerate(samples):
        s.routes = coded(1, 6, 3, 2)[0][: len(s.prompt_ids) + len(s.response_ids) - 1] + i
    batch = build_batch(samples, 0, target=torch.device("cpu"))
    routes = batch.routes
    assert routes.shape == (2, 7, 3, 2) and routes.dtype == torch.uint8
    assert torch.equal(routes[0, :6], torch.from_numpy(samples[0].routes))
    assert torch.equal(routes[1, :2], torch.from_numpy(samples[1].routes))
    # no engine route: each row's last token and the padding get experts 0..k-1
    for b, start in ((0, 6), (1, 2)):
        assert (routes[b, start:] == torch.tensor([0, 1], dtype=torch.uint8)).all()
    # the rows travel with select / trim, as the other per-row tensors do
    sub = batch.select([1]).trim(3, 1)
    assert torch.equal(sub.routes, routes[1:2, :3])


def test_batch_routes_absent_or_wrong_length():
    assert build_batch([sample(2, 2), sample(2, 2)], 0, target=torch.device("cpu")).routes is None
    partial = [sample(2, 2, coded(1, 3)[0]), sample(2, 2)]   # one sample without: no replayable batch
    assert build_batch(partial, 0, target=torch.device("cpu")).routes is None
    with pytest.raises(ValueError, match=r"sample 0: Sample.routes has 4 rows for 3 input tokens"):
        layout.batch_routes([sample(2, 2, coded(1, 4)[0])], 8)


def test_a_refused_sample_takes_filler_and_the_batch_keeps_its_routes():
    """A sample the engines refused (no response, no routes: nothing of it trains) beside
    routed ones: the batch is replayable, the refused row is filler, its routed length 0."""
    routed = sample(3, 2, coded(1, 4)[0])
    refused = Sample([1] * 5, [], [], [], False, 0, finish_reason="refused")
    batch = build_batch([routed, refused], 0, target=torch.device("cpu"))
    assert batch.routes is not None and batch.route_lens.tolist() == [4, 0]
    assert torch.equal(batch.routes[0, :4], torch.from_numpy(routed.routes))
    assert (batch.routes[1] == torch.tensor([0, 1], dtype=torch.uint8)).all()


def episode(mask: list[int], rows: int | None, prompt: int = 3) -> Sample:
    """An episode of len(mask) response tokens (0: observation) with its first `rows` routes."""
    s = sample(prompt, len(mask), None if rows is None else coded(1, prompt + len(mask) - 1)[0][:rows])
    s.mask = list(mask)
    return s


def test_routes_must_cover_every_position_before_the_last_trained_token():
    """Response token j (at position prompt + j) is predicted from position prompt + j - 1, so
    its logprob depends on the routes of positions 0 .. prompt + j - 1 only (causal
    attention): an episode carried between turns (its observation never fed to an engine) has
    rows for every position before its last model token, and the rest take filler."""
    between_turns = episode([1, 1, 0, 0], 3 + 2 - 1)   # the model turn's rows: prompt + turn - 1
    assert between_turns.routes_needed == 4
    batch = build_batch([between_turns, sample(2, 2, coded(1, 3)[0])], 0, target=torch.device("cpu"))
    assert batch.routes is not None and batch.route_lens.tolist() == [4, 3]
    assert torch.equal(batch.routes[0, :4], torch.from_numpy(between_turns.routes))
    assert (batch.routes[0, 4:] == torch.tensor([0, 1], dtype=torch.uint8)).all()
    # a trained token past the rows, or none at all while tokens train: an engine that did not
    # capture them, refused (routing_replay.prepare names it)
    assert layout.batch_routes([episode([1, 1, 0, 1], 4)], 8) is None
    assert layout.batch_routes([episode([1, 1, 0, 0], 3)], 8) is None
    assert layout.batch_routes([episode([1, 1], None), between_turns], 8) is None
    # nothing trained (an episode cut by its budget at a first observation): no row needed
    assert episode([0, 0], None).routes_needed == 0
    assert layout.batch_routes([episode([0, 0], None), between_turns], 8) is not None


def test_ids_past_255_widen_the_dtype():
    routes = coded(1, 3)[0].astype(np.uint16)
    routes[0, 0, 0] = 300
    out = layout.batch_routes([sample(2, 2, routes)], 4)
    assert out.dtype == torch.int16 and int(out[0, 0, 0, 0]) == 300


def test_sequence_major_is_the_routers_token_order():
    """megatron's router flattens hidden states [s, b, h] into tokens s * b + row."""
    routes = torch.from_numpy(coded(3, 5, layers=3))
    per_layer = layout.sequence_major(routes, [2, 0])
    assert len(per_layer) == 2
    for idx, column in zip(per_layer, [2, 0]):
        assert idx.dtype == torch.int64 and idx.shape == (15, 2)
        for s in range(5):
            for b in range(3):
                assert torch.equal(idx[s * 3 + b], routes[b, s, column].long())
        assert torch.equal(layout.batch_major(idx, 3), routes[:, :, column].long())


def test_sequence_parallel_ranks_take_their_part_of_the_sequence():
    routes = torch.from_numpy(coded(2, 6))
    whole = layout.sequence_major(routes, [1])[0]
    parts = [layout.sequence_major(routes, [1], rank, 3)[0] for rank in range(3)]
    assert all(p.shape == (4, 2) for p in parts)
    assert torch.equal(torch.cat(parts), whole)   # rank r holds positions [2r, 2r + 2): rows s * b + row
    with pytest.raises(ValueError, match="does not split over 4"):
        layout.sequence_major(routes, [0], 0, 4)


@pytest.mark.parametrize("layers,step,mlp_only,stages,want", [
    (4, 1, [], 2, [[0, 1], [2, 3]]),
    (4, 1, [1], 2, [[0], [1, 2]]),       # a dense layer has no router and no column
    (6, 2, [], 3, [[0], [1], [2]]),      # decoder_sparse_step=2: layers 1, 3, 5 are MoE
    (4, 2, [], 2, [[0], [1]]),
])
def test_stage_columns_are_the_stages_moe_layers(layers, step, mlp_only, stages, want):
    moe = sparse_layer_indices(layers, step, mlp_only)
    freq = [int(i in moe) for i in range(layers)]
    per = layers // stages
    got = [layout.stage_columns(freq, range(p * per, (p + 1) * per)) for p in range(stages)]
    assert got == want


def test_scored_positions_skip_padding_last_token_and_filler_rows():
    route_lens = torch.tensor([4, 2, 4]) - 1      # full rows: every position but the last
    trained = torch.tensor([True, True, False])   # row 2: a filler copy
    keep = layout.scored_positions(route_lens, trained, 4).view(4, 3)   # [s, b]
    want = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 0, 0], [0, 0, 0]], dtype=torch.bool)
    assert torch.equal(keep, want)
    assert torch.equal(layout.scored_positions(route_lens, trained, 4, 1, 2), want[2:].reshape(-1))


def test_scored_positions_count_only_routed_positions():
    """routing_agreement compares the engine's experts with the trainer's: a row's positions
    past its engine routes (filler: an episode's observation not yet fed, a refused sample)
    are not scored."""
    route_lens = torch.tensor([3, 1, 0])
    trained = torch.tensor([True, True, True])
    keep = layout.scored_positions(route_lens, trained, 4).view(4, 3)
    want = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 0, 0], [0, 0, 0]], dtype=torch.bool)
    assert torch.equal(keep, want)


def test_same_sets_ignore_the_order_within_top_k():
    a = torch.tensor([[0, 1], [2, 3], [1, 3]])
    b = torch.tensor([[1, 0], [2, 3], [1, 2]], dtype=torch.uint8)
    assert layout.same_sets(a, b).tolist() == [True, True, False]


def test_a_dense_model_refuses_routing_replay():
    transformers = pytest.importorskip("transformers")
    from megarl.models.transformer_config import moe_settings
    dense = transformers.Qwen2Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=4)
    with pytest.raises(ValueError, match=r"algo.routing_replay=r3 .* has no experts: set algo.routing_replay=off"):
        moe_settings(dense, "Qwen2ForCausalLM", 1, "alltoall", False, routing_replay="r3")
    assert moe_settings(dense, "Qwen2ForCausalLM", 1, "alltoall", False) == {}


def test_r2_refuses_the_intra_step_overlap():
    """rollout.overlap computes the old-logprob pass during the round, where r2 cannot record."""
    from megarl.config import ConfigError, load_config
    with pytest.raises(ConfigError, match=r"algo.routing_replay='?r2'?.*rollout.overlap=false"):
        load_config("recipes/tiny_cpu.yaml", ["algo.routing_replay=r2", "rollout.mode=partial", "rollout.overlap=true"])
    assert load_config("recipes/tiny_cpu.yaml", ["algo.routing_replay=r3", "rollout.mode=partial",
                                                 "rollout.overlap=true"]).algo.routing_replay == "r3"


@pytest.mark.parametrize("role,want", [("actor", "r3"), ("reference", "r3"), ("critic", "off")])
def test_only_the_policy_models_replay(role, want):
    """The actor and the reference replay the engine's experts; a critic from the same MoE
    checkpoint routes on its own (its values are not logprobs of the sampled tokens)."""
    transformers = pytest.importorskip("transformers")
    from megarl.config import load_config
    from megarl.models.setup import moe_layout
    hf = transformers.Qwen3MoeConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                     head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                                     norm_topk_prob=True)
    hf.architectures = ["Qwen3MoeForCausalLM"]
    cfg = load_config("recipes/tiny_cpu.yaml", ["algo.routing_replay=r3"])
    assert moe_layout(cfg, hf, role)["router"]["routing_replay"] == want


@pytest.mark.parametrize("shape,top", [((1, 4, 3, 2), 1), ((1, 4, 2, 4), 1), ((1, 4, 2, 2), 4)],
                         ids=["layers", "topk", "expert_id"])
def test_routes_of_another_model_are_refused(shape, top):
    """Routes from engines serving another architecture (MoE layers, top-k, expert count)."""
    from types import SimpleNamespace

    from megarl.ppo.routing_replay import RouteReplay
    config = SimpleNamespace(moe_layer_freq=[1, 1], num_layers=2, moe_router_topk=2, num_moe_experts=4,
                             sequence_parallel=False)
    control = RouteReplay(torch.nn.Module(), config)
    control.check(torch.ones((1, 4, 2, 2), dtype=torch.uint8))
    routes = torch.zeros(shape, dtype=torch.uint8)
    routes[0, 0, 0, 0] = top
    with pytest.raises(ValueError, match=r"Sample.routes hold .* and the model has 2 MoE layers x top-2 of 4 experts"):
        control.check(routes)
