"""Multi-turn episodes in the partial-rollout controller, against scripted engines.

Pins: an episode is one token sequence whose model tokens are exactly what the engines
produced and whose observation tokens (mask 0, behaviour logprob 0) are the environment's
answers, in order; episodes carried across rounds and weight updates, mid-turn and between
turns, lose and duplicate no token and keep each model token's version; every request's prompt
is a prefix of the final sequence (what the engine conditioned on is what the trainer reads);
environments that raise, answer nonsense or time out end their episode with reward 0, counted,
and the run goes on; a checkpoint mid-episode resumes by replaying the environment.
"""
import asyncio
import re

import torch
from scripted_engine import TOKEN0, Clock, ScriptedEngine, behaviour_logprob

from megarl.envs.base import Environment, EnvSpec, StepResult
from megarl.envs.episodes import EpisodeDriver
from megarl.metrics.step import episode_metrics
from megarl.ppo.batch import build_batch
from megarl.rollout.controller.partial import PartialRolloutController
from megarl.rollout.engines.pool import EnginePool

PROMPT = [7, 7]
OBS0 = 500                      # observation i is two tokens OBS0 + i


def turn_len(gid: int, index: int, k: int) -> int:
    """Model turn k of an episode: mostly short, now and then long (carried mid-turn)."""
    return 25 if (gid + index + k) % 5 == 0 else 2 + (gid + 2 * index + k) % 3


def turns_of(gid: int, index: int) -> int:
    return 1 + (gid + index) % 3


class TurnEngine(ScriptedEngine):
    """Token at response position p is TOKEN0 + p; a turn stops after turn_len tokens. Logs
    every prompt it was sent."""

    def __init__(self, name, clock, log):
        super().__init__(name, clock)
        self.log = log

    async def generate(self, req):
        gid, index = map(int, re.match(r"g(\d+)s(\d+)a\d+", req.key).groups())
        done = req.prompt_ids[len(PROMPT):]
        self.log.append((gid, index, list(req.prompt_ids)))
        starts = [i + 1 for i, t in enumerate(done) if OBS0 <= t < TOKEN0]
        start = starts[-1] if starts else 0
        k = sum(1 for i, t in enumerate(done) if OBS0 <= t < TOKEN0 and (i + 1 == len(done) or done[i + 1] >= TOKEN0))
        length = start + turn_len(gid, index, k)
        return await super().generate(type(req)(req.key, [gid, index, length, *done], req.max_tokens,
                                                req.temperature, req.top_p, req.seed))


class WordTokenizer:
    """Ids <-> words: decode joins ids; "o<i>" encodes as two OBS0 + i tokens."""
    chat_template = None
    eos_token = None

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))

    def __call__(self, text, add_special_tokens=False):
        m = re.fullmatch(r"o(\d+)", text)
        return {"input_ids": [OBS0 + int(m.group(1))] * 2 if m else []}


class CountingEnv(Environment):
    """Answers turn i with "o<i>"; done after turns_of(record) turns, reward = that count.
    record["fail"]: "error" raises at the 1st step, "timeout" sleeps past env.timeout_s,
    "nonsense" answers a non-StepResult, "nan" a NaN reward."""

    async def reset(self, record):
        self.turns, self.record = 0, record
        return None

    async def step(self, turn):
        assert turn.split() and all(int(w) >= TOKEN0 for w in turn.split()), turn   # model tokens only
        self.turns += 1
        fail = self.record.get("fail")
        if fail == "error":
            raise RuntimeError("the environment broke")
        if fail == "timeout":
            await asyncio.sleep(30)
        if fail == "nonsense":
            return {"observation": "o1"}
        await asyncio.sleep(0.002)   # real time on the environment loop: some steps run at a round's end
        if self.turns >= self.record["turns"]:
            return StepResult(reward=float("nan") if fail == "nan" else float(self.turns), done=True)
        return StepResult(observation=f"o{self.turns}")


class ClockedEpisodes(EpisodeDriver):
    """The engines' clock stands still while an environment answers (on its own thread, in
    wall time): how many tokens the other requests make meanwhile depends on the script
    alone, not on the machine's load, so which episodes are carried mid-turn is the same on
    every machine."""

    def __init__(self, clock, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.clock = clock

    async def _call(self, coro, what):
        async with self.clock.holding():
            return await super()._call(coro, what)


async def drive(rounds, *, target=2, n=2, concurrency=6, update_mode="abort", state=None, fail=None,
                max_turns=5, log=None, version=0, env=None, policy="finish", max_staleness=8, max_new=200,
                on_round=None, tokenizer=None, refuse=None):
    """`rounds` rounds as the trainer runs them. env: the environment class (CountingEnv);
    tokenizer (a WordTokenizer); on_round(ctl, version) after each round's groups were taken;
    refuse(req): the engines refuse a request as invalid (ScriptedEngine.refuse)."""
    clock = Clock()
    clock.start()
    log = [] if log is None else log
    pool = EnginePool([TurnEngine(f"e{i}", clock, log) for i in range(2)], 30, update_mode=update_mode)
    for e in pool.engines:
        e.refuse = refuse or e.refuse
    episodes = ClockedEpisodes(clock, EnvSpec("counting", env or CountingEnv), tokenizer or WordTokenizer(),
                               max_turns=max_turns, timeout_s=0.5)
    gid = [0]

    def new_group():
        g = gid[0]
        gid[0] += 1
        record = {"gid": g, "turns": turns_of(g, 0)}
        if fail and g in fail:
            record["fail"] = fail[g]
        return record, list(PROMPT)
    ctl = PartialRolloutController(pool, n=n, concurrency=concurrency, max_new_tokens=max_new, temperature=1.0,
                                   max_staleness=max_staleness, stale_policy=policy, new_group=new_group,
                                   score=lambda s: s.reward, seed=0, episodes=episodes)
    if state is not None:
        ctl.load_state_dict(state)
        gid[0] = ctl.next_gid
    for e in pool.engines:
        e.version = version
    trained, metrics = [], []
    try:
        for _ in range(rounds):
            groups = await ctl.run_round(target, version)
            ctl.take_ready()
            trained.append((version, groups))
            metrics.append(ctl.metrics())
            if on_round:
                on_round(ctl, version)
            version += 1
            await pool.reload_weights("/nowhere", version)
            if update_mode == "keep":
                await pool.resume_all()
                await asyncio.sleep(0)
    finally:
        clock.stop()
        episodes.close()
    return ctl, trained, metrics, log


def check_episode(g, s, version):
    # the env's record drives turns_of(gid, 0) for every sample of the group; the engine's turn
    # lengths differ per sample: rebuild the expectation with the record's turn count
    ids, mask = [], []
    for k in range(g.record["turns"]):
        n = turn_len(g.gid, s.index, k)
        ids += [TOKEN0 + p for p in range(len(ids), len(ids) + n)]
        mask += [1] * n
        if k + 1 < g.record["turns"]:
            ids += [OBS0 + k + 1] * 2
            mask += [0, 0]
    assert s.response_ids == ids, (g.gid, s.index)
    assert s.mask == mask
    assert s.logprobs == [behaviour_logprob(p) if m else 0.0 for p, m in enumerate(mask)]
    model_versions = [v for v, m in zip(s.versions, mask) if m]
    assert model_versions == sorted(model_versions) and max(s.versions) <= version
    assert s.turns == g.record["turns"] and s.finish_reason == "stop"


def test_episodes_are_token_exact_across_rounds_and_updates():
    """Episodes carried over 8 rounds (abort mode: each carried turn is continued as prompt +
    tokens so far): every trained episode is exactly its script, the reward is the
    environment's, some were carried mid-turn and some between turns, some span versions,
    and every prompt an engine got is a prefix of the trained sequence."""
    ctl, trained, metrics, log = asyncio.run(drive(8))
    finals = {}
    for version, groups in trained:
        for g in groups:
            assert g.rewards == [float(g.record["turns"])] * len(g.slots)
            for s in g.slots:
                check_episode(g, s, version)
                finals[(g.gid, s.index)] = PROMPT + s.response_ids
    assert len(finals) == 8 * 2 * 2   # rounds x groups x samples, each trained once
    assert sum(m["episodes_carried_mid_turn"] for m in metrics) > 0
    assert sum(m["episodes_carried_between_turns"] for m in metrics) > 0
    assert any(len(set(s.versions)) > 1 for _, gs in trained for g in gs for s in g.slots)
    for gid, index, prompt in log:
        if (gid, index) in finals:
            assert finals[(gid, index)][:len(prompt)] == prompt, (gid, index)
    assert sum(m["env_errors"] + m["env_timeouts"] for m in metrics) == 0


def test_keep_mode_carries_held_turns_without_losing_tokens():
    """rollout.update_mode=keep: a turn held over the update goes on under the new version."""
    _, trained, metrics, _ = asyncio.run(drive(6, update_mode="keep"))
    spanning = 0
    for version, groups in trained:
        for g in groups:
            for s in g.slots:
                check_episode(g, s, version)
                spanning += len(set(s.versions)) > 1
    assert spanning > 0


def test_broken_environments_score_zero_and_are_counted():
    """Groups 1, 2, 3, 4 have an environment that raises, times out, answers nonsense, gives
    a NaN reward: their episodes end with reward 0 (counted), the others finish normally."""
    fail = {1: "error", 2: "timeout", 3: "nonsense", 4: "nan"}
    _, trained, metrics, _ = asyncio.run(drive(4, fail=fail, target=2))
    seen = set()
    for _, groups in trained:
        for g in groups:
            seen.add(g.gid)
            if g.gid in fail:
                assert g.rewards == [0.0] * len(g.slots), (g.gid, g.rewards)
            else:
                assert g.rewards == [float(g.record["turns"])] * len(g.slots)
    assert {1, 2, 3, 4} <= seen
    assert sum(m["env_timeouts"] for m in metrics) == 2           # both episodes of group 2
    assert sum(m["env_errors"] for m in metrics) == 6             # groups 1, 3, 4


def test_max_turns_cuts_the_episode():
    """env.max_turns=1: every episode ends after its first model turn, cut ("length")."""
    _, trained, _, _ = asyncio.run(drive(2, max_turns=1))
    for _, groups in trained:
        for g in groups:
            for s in g.slots:
                assert s.turns == 1 and 0 not in s.mask
                assert s.finish_reason == ("stop" if g.record["turns"] == 1 else "length")


def test_checkpoint_mid_episode_resumes_by_replay():
    """State saved after 3 rounds (episodes open mid-episode) and loaded into a new controller
    with fresh environments: the resumed run replays each open episode's turns into its new
    environment, so the observations that follow are the right ones (a fresh environment
    would answer o1 again) and every trained episode is exact."""
    # which episodes are open when a round ends depends on the threads' timing (the loaded CI
    # once ended round 3 with none between turns): the precondition is sought over a few
    # round counts, so the test checks the replay, not the timing
    for rounds in (3, 2, 4, 5, 6):
        ctl, first, _, _ = asyncio.run(drive(rounds))
        state = ctl.state_dict()
        open_turns = [s["turns"] for g in state["open"] for s in g["slots"] if not s["finish_reason"]]
        if any(t >= 1 for t in open_turns):
            break
    assert any(t >= 1 for t in open_turns), "no checkpoint held an episode between turns"
    ctl2, trained, metrics, _ = asyncio.run(drive(4, state=state, version=rounds))
    assert sum(m["env_replays"] for m in metrics) > 0
    assert sum(m["env_replay_mismatches"] for m in metrics) == 0
    for version, groups in trained:
        for g in groups:
            for s in g.slots:
                check_episode(g, s, version)


def test_observation_tokens_are_never_trained():
    """build_batch: resp_mask is 0 on observation tokens (no loss, no KL, no advantage)."""
    ctl, trained, _, _ = asyncio.run(drive(2))
    samples = [smp for _, gs in trained for g in gs for smp in ctl.samples_of(g)]
    batch = build_batch(samples, pad_id=0, target=torch.device("cpu"))
    for i, smp in enumerate(samples):
        r = len(smp.response_ids)
        assert batch.resp_mask[i, :r].tolist() == [float(m) for m in smp.mask]
        assert batch.resp_mask[i, r:].sum() == 0
        obs = [j for j, m in enumerate(smp.mask) if not m]
        assert all(OBS0 <= smp.response_ids[j] < TOKEN0 for j in obs)
    m = episode_metrics(samples)
    assert m["observation_tokens_mean"] == sum(len(s.mask) - sum(s.mask) for s in samples) / len(samples)
    assert m["episode_turns_mean"] == sum(s.turns for s in samples) / len(samples)
