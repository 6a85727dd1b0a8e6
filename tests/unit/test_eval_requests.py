"""The evaluation's requests on scripted engines (megarl/eval/generate.py): at most
eval.concurrency in flight, refusals in place, seeds of a stream of their own, and a
partial-rollout round beside them that fills its own concurrency and never aborts them."""
import asyncio

from scripted_engine import TOKEN0, Clock, ScriptedEngine, run_on_clock
from test_abort_scope import Either
from test_rollout_stress import PROMPT, long_tail

from megarl.data import seeds
from megarl.eval.generate import eval_requests, generate_limited
from megarl.rollout.controller.partial import PartialRolloutController
from megarl.rollout.engines.engine import GenRequest, RequestError
from megarl.rollout.engines.pool import EnginePool


def test_eval_seed_is_pinned():
    """A formula change would change every sampled evaluation's draws (tests/unit/test_seeds.py)."""
    assert seeds.eval_prompt_seed(7, 1, 2) == 7_120_253
    assert seeds.eval_prompt_seed(2**40, 0, 3) == (2**40 * 1_000_033 + 30_028) % seeds.MODULUS


def test_eval_requests_draw_the_same_seeds_at_every_version_and_none_when_greedy():
    prompts = [[5, 6], [7]]
    v0 = eval_requests(0, 1, prompts, 3, 8, 0.7, run_seed=11)
    v4 = eval_requests(4, 1, prompts, 3, 8, 0.7, run_seed=11)
    assert [r.seed for r in v0] == [r.seed for r in v4]
    assert len({r.seed for r in v0}) == 6 and len({r.key for r in v0 + v4}) == 12
    assert [r.prompt_ids for r in v0] == [[5, 6]] * 3 + [[7]] * 3
    other = eval_requests(0, 2, prompts, 3, 8, 0.7, run_seed=11)
    assert not {r.seed for r in v0} & {r.seed for r in other}        # datasets draw apart
    assert all(r.seed is None for r in eval_requests(0, 1, prompts, 3, 8, 0.0, run_seed=11))
    # keys of their own: never the controller's g<gid>s<i>a<n> nor the sync round's <step>-g<i>s<j>
    assert all(r.key.startswith("eval") for r in v0)


def test_at_most_the_limit_in_flight_and_refusals_in_place():
    def refuse(req):
        return "prompt too long" if req.key == "r3" else None

    async def main(clock):
        pool = EnginePool([ScriptedEngine(f"e{i}", clock, refuse=refuse) for i in range(2)], 30)
        requests = [GenRequest(f"r{i}", [0, i, 5], 16) for i in range(10)]
        done = [0]
        results = await generate_limited(pool, requests, 3, done)
        return results, done[0], max(clock.running_total)
    results, done, most = run_on_clock(main)
    assert done == 10 and most <= 3
    assert isinstance(results[3], RequestError)
    for i, r in enumerate(results):
        if i != 3:
            assert r.key == f"r{i}" and r.token_ids == [TOKEN0 + p for p in range(5)] and r.finish_reason == "stop"


def test_a_round_beside_the_evaluation_fills_its_own_concurrency_and_leaves_it_running():
    """The controller counts only its own requests: with 6 evaluation requests on the engines
    it still keeps `concurrency` of its own in flight, and its round's end (abort mode) aborts
    none of the evaluation's."""
    concurrency, evals = 8, 6

    async def main():
        clock = Clock()
        clock.start()
        pool = EnginePool([Either(f"e{i}", clock, long_tail) for i in range(2)], 30)
        ctl = PartialRolloutController(pool, n=4, concurrency=concurrency, max_new_tokens=64, temperature=1.0,
                                       max_staleness=8, new_group=lambda: ({}, list(PROMPT)),
                                       score=lambda s: 0.0, seed=0, sample_every_s=None)
        requests = [GenRequest(f"eval0-d0-p{i}s0", [0, i, 200], 200) for i in range(evals)]
        done = [0]
        running = asyncio.ensure_future(generate_limited(pool, requests, 256, done))
        try:
            await ctl.run_round(3, 0)
            assert not running.done()
            results = await running
        finally:
            clock.stop()
        return ctl, results, clock.running_total
    ctl, results, running_total = asyncio.run(main())
    assert max(running_total) == concurrency + evals, max(running_total)
    assert ctl.metrics()["aborted_inflight"] > 0, "the round must have aborted its own requests"
    assert all(r.finish_reason == "stop" and len(r.token_ids) == 200 for r in results)


def test_eval_top_p_reaches_every_request():
    """eval.top_p: evaluation computes no trainer logprobs, so a nucleus cut is allowed there."""
    prompts = [[5, 6], [7]]
    assert {r.top_p for r in eval_requests(0, 1, prompts, 2, 8, 0.7, run_seed=11, top_p=0.9)} == {0.9}
    assert {r.top_p for r in eval_requests(0, 1, prompts, 2, 8, 0.7, run_seed=11)} == {1.0}
