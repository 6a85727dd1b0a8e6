"""Subprocess body of test_partial_rollout: a greedy sample carried over a weight sync.

A real in-process vLLM engine, the partial-rollout controller with concurrency 2 and one
group per round: a short prompt completes first and ends the round, so the long prompt's
sample is carried mid-way. The engine then reloads the unchanged weights (a sync that
changes nothing) and the next rounds finish the sample: with rollout.update_mode=abort it
was aborted and continues as a new request from its prompt + partial tokens; with keep the
same request was held over the update and goes on. Writes the carried sample of each mode
and an uninterrupted greedy run of the same prompt.
usage: carry_probe.py MODEL_DIR OUT_JSON
"""
import itertools
import json
import sys


def carried(pool, model_dir, long_prompt, short_prompt) -> dict:
    """A round at the engines' version ends with the long greedy sample unfinished; the
    unchanged weights are loaded as the next version; later rounds finish it. Its tokens,
    versions and requests sent."""
    version = pool.version
    from megarl.rollout.controller.partial import PartialRolloutController
    # as many short prompts as the rounds take: each round draws one or two, and how many rounds
    # the long sample needs depends on the machine's load (StopIteration from a finite list
    # would end the probe before the round cap below says what went wrong)
    prompts = itertools.chain([long_prompt], itertools.repeat(short_prompt))
    ctl = PartialRolloutController(
        pool.pool, n=1, concurrency=2, max_new_tokens=56, temperature=0.0, max_staleness=5,
        stale_policy="restart", new_group=lambda: ({}, next(prompts)), score=lambda s: 0.0, seed=0)
    first = pool.call(ctl.run_round(1, version), f"round {version}")
    partial = list(ctl.groups[0].slots[0].response_ids) if 0 in ctl.groups else None
    pool.reload_weights(model_dir, version + 1)      # the HF files themselves: nothing changes
    long_done, rounds = None, 0
    # each round ends as soon as a short sample completes, so the long one gains a few
    # tokens per round, fewer on a loaded machine: allow rounds enough for its whole budget
    while long_done is None and rounds < 1000:
        rounds += 1
        for g in pool.call(ctl.run_round(1, version + 1), f"round {rounds}"):
            if g.gid == 0:
                long_done = g.slots[0]
    assert long_done is not None, f"the long sample did not finish in {rounds} rounds"
    return {"first_round_gid": first[0].gid, "partial_len": len(partial or []),
            "carried": long_done.response_ids, "carried_logprobs": long_done.logprobs,
            "versions": long_done.versions, "finish_reason": long_done.finish_reason,
            "requests": long_done.attempts, "start_version": version}


def main(model_dir: str, out_path: str) -> None:
    from transformers import AutoTokenizer

    from megarl.config import load_config
    from megarl.rollout.engines.engine import GenRequest
    from megarl.rollout.engines.pool import open_pool

    cfg = load_config("recipes/tiny_cpu.yaml", [f"model.path={model_dir}", "rollout.engines.count=1"])
    tok = AutoTokenizer.from_pretrained(model_dir)
    long_prompt = tok("<bos> n40 =", add_special_tokens=False)["input_ids"]
    short_prompt = tok("<bos> n3 =", add_special_tokens=False)["input_ids"]
    pool = open_pool(cfg.rollout, model_dir, 0, "/tmp")
    try:
        ref = pool.call(pool.pool.generate(GenRequest("ref", long_prompt, 56, temperature=0.0)), "reference")

        async def abort_at_once():   # abort before vLLM has even registered the requests
            import asyncio
            reqs = [GenRequest(f"early{i}", short_prompt, 200, ignore_eos=True, seed=i) for i in range(4)]
            tasks = [asyncio.ensure_future(pool.pool.generate(r)) for r in reqs]
            await asyncio.sleep(0)
            await pool.pool.abort()
            return [(len(t.result().token_ids), t.result().finish_reason) for t in tasks]
        early = pool.call(abort_at_once(), "early abort")
        out = {"reference": ref.token_ids, "reference_logprobs": ref.logprobs, "early_abort": early}
        for mode in ("abort", "keep"):
            pool.pool.update_mode = mode       # rollout.update_mode (keep_kv=false, the default)
            out[mode] = carried(pool, model_dir, long_prompt, short_prompt)
        out["engine_version"] = pool.version
    finally:
        pool.close()
    with open(out_path, "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
