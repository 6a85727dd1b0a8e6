"""The driver's evaluation (megarl/eval/runner.py) on a scripted engine pool: the schedule, the
row and its console line, refusals scored 0 and counted, the dump the figures are recomputed
from, the verifier's own counts, and the prefix cache emptied after a sync evaluation."""
import json
import logging

import pytest
from scripted_engine import TOKEN0, Clock, ScriptedEngine

from megarl.config.loader import load_config
from megarl.eval.datasets import load_eval_sets
from megarl.eval.runner import Evaluator
from megarl.metrics.logger import MetricsLogger
from megarl.rollout.engines.engine import EngineError
from megarl.rollout.engines.pool import EnginePool, LoopThread, SyncPool

REFUSED_LENGTH = 999


class Tokenizer:
    """Prompts "gid index length" -> the scripted engine's [gid, index, length]; responses read
    back as 'answer: <ids>' so the `exact` verifier and its answer extractor see them."""

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [int(x) for x in text.split()]}

    def decode(self, ids, skip_special_tokens=False):
        return "answer: " + " ".join(map(str, ids))


class NoCacheReset(ScriptedEngine):
    async def clear_kv(self):
        raise EngineError(f"engine {self.name}: /reset_prefix_cache answered 404")


@pytest.fixture
def pool():
    loop = LoopThread()

    async def start_clock():
        clock = Clock()
        clock.start()
        return clock
    clock = loop.run(start_clock(), 10)
    refuse = lambda req: "prompt too long" if req.prompt_ids[2] == REFUSED_LENGTH else None   # noqa: E731
    engines = [ScriptedEngine("e0", clock, refuse=refuse), NoCacheReset("e1", clock, refuse=refuse)]
    sync = SyncPool(EnginePool(engines, 30), loop, 10)
    yield sync
    loop.run(_stop(clock), 10)
    sync.close()


async def _stop(clock):
    clock.stop()


def test_an_evaluation_logs_its_row_dump_and_line_and_counts_refusals(pool, tmp_path, caplog):
    rows = [{"prompt": "0 0 2", "answer": f"{TOKEN0} {TOKEN0 + 1}"},            # right
            {"prompt": "0 1 3", "answer": "nope"},                               # wrong
            {"prompt": f"0 2 {REFUSED_LENGTH}", "answer": "x"}]                  # refused by the engine
    held = tmp_path / "held.jsonl"
    held.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = load_config("recipes/tiny_cpu.yaml", [f"run.dir={tmp_path / 'run'}", "rollout.mode=sync", "train.steps=3",
                                                f"eval.datasets=[{held}]", "eval.verifiers=[exact]", "eval.every=2",
                                                "eval.n=2", "eval.k=[1,2]", "eval.temperature=0.5"])
    logger = MetricsLogger(cfg.run.dir, cfg.train.steps, tensorboard=False, progress=True)
    lines = []
    logger.bar.write = lines.append
    ev = Evaluator(cfg, load_eval_sets(cfg), pool, Tokenizer(), logger)
    with caplog.at_level(logging.WARNING, "megarl.eval"):
        for step in range(cfg.train.steps):
            ev.at(step)
        ev.at_end(cfg.train.steps - 1, start=0)
    ev.close()
    logger.close()
    logged = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged] == [0, 2, 3]
    p = "eval/held/"
    for r in logged:
        assert r[p + "prompts"] == 3 and r[p + "refused"] == 2
        assert r[p + "pass@1"] == pytest.approx(1 / 3) and r[p + "pass@2"] == pytest.approx(1 / 3)
        assert r[p + "mean@2"] == pytest.approx(1 / 3) and r[p + "maj@2"] == pytest.approx(1 / 3)
        assert r[p + "reward_errors"] == 0 and r[p + "finished_frac"] == pytest.approx(4 / 6)
        assert r[p + "response_len_mean"] == pytest.approx((2 * 2 + 3 * 2) / 6)
    assert len(lines) == 3
    assert lines[0].startswith("eval    0 | held mean@2=0.333 pass@1=0.333 pass@2=0.333 maj@2=0.333")
    dumped = [json.loads(x) for x in (tmp_path / "run" / "eval" / "held" / "step_2.jsonl").read_text().splitlines()]
    assert [(d["prompt_index"], d["sample_index"], d["correct"]) for d in dumped] == \
        [(0, 0, True), (0, 1, True), (1, 0, False), (1, 1, False), (2, 0, False), (2, 1, False)]
    assert dumped[0]["answer"] == f"{TOKEN0} {TOKEN0 + 1}" and dumped[4]["finish_reason"] == "refused"
    # one engine could not empty its prefix cache: said once, not at every evaluation
    assert caplog.text.count("prefix cache could not be emptied") == 1
