"""Multi-turn episodes in the partial-rollout controller: the environment's side of a slot.

A slot of an episode group is one episode. Its token lists hold the model's tokens as the
engines sampled them and the observation tokens appended between turns (`Slot.mask` 0 there,
behaviour logprob 0.0, the version of the turn they answer: `reset`'s first observation the
version the episode started under), so the trainer's sequence is exactly what the engine
conditioned on. The controller calls:
- `ensure(slot, group, budget, version)` before a request: the episode's environment is live
  (made and `reset`, or, after a resume, replayed: reset, then `step` with each recorded turn);
- `after_turn(slot, group, budget)` when a model turn ended on EOS / a stop token: the
  environment answers; the episode ends (done, `env.max_turns`, the token budget) or its
  observation is appended and the slot waits for its next model turn.
An observation that leaves no room for a model token in the budget (`rollout.sampling.max_new_tokens`)
is not appended: the episode ends there, cut by the budget ("length", counted as
`env_budget_ends`) with the rewards the environment gave so far (0 for a first observation).
Everything the controller keeps is plain data on the slot (checkpointed with it); the live
environment objects stay here, keyed by (group, index, restarts). An environment that raises,
answers nonsense or runs past `env.timeout_s` ends its episode with reward 0 and is counted.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import math
import time

from megarl.config.errors import ConfigError
from megarl.envs.base import EnvSpec, StepResult, env_spec
from megarl.envs.render import ObservationRenderer
from megarl.envs.runner import EnvFailure, EnvRunner, EnvTimeout

log = logging.getLogger("megarl.envs")


class EpisodeDriver:
    """The environments of one controller's episodes (all methods on the rollout loop)."""

    def __init__(self, spec: EnvSpec, tokenizer, *, max_turns: int, timeout_s: float,
                 options: dict | None = None, template: str = "auto", runner: EnvRunner | None = None):
        self.spec, self.tokenizer, self.options = spec, tokenizer, dict(options or {})
        self.max_turns, self.timeout_s = max_turns, timeout_s
        self.renderer = ObservationRenderer(tokenizer, template)
        self.runner = runner or EnvRunner()
        self._envs: dict[tuple[int, int, int], object] = {}
        self.counts = {"env_errors": 0, "env_timeouts": 0, "env_calls": 0, "env_replays": 0,
                       "env_replay_mismatches": 0, "env_budget_ends": 0}
        self.env_time_s = 0.0
        self._closing: set = set()    # environments' close() calls still running

    @staticmethod
    def _key(slot) -> tuple[int, int, int]:
        return slot.gid, slot.index, slot.restarts

    def live(self, slot) -> bool:
        return self._key(slot) in self._envs

    # -- environment calls ------------------------------------------------------------------
    async def _call(self, coro, what: str):
        t0 = time.perf_counter()
        self.counts["env_calls"] += 1
        try:
            return await self.runner.call(coro, self.timeout_s, what)
        finally:
            self.env_time_s += time.perf_counter() - t0

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _fail(self, slot, err: EnvFailure) -> None:
        """End the episode with reward 0: the environment broke, the run goes on."""
        timeout = isinstance(err, EnvTimeout)
        self.counts["env_timeouts" if timeout else "env_errors"] += 1
        n = self.counts["env_timeouts" if timeout else "env_errors"]
        if n <= 3:   # the first few with their cause; the rest only counted (metrics)
            log.warning("episode g%d s%d ends with reward 0: %s", slot.gid, slot.index, err)
        slot.env_status = "timeout" if timeout else "error"
        slot.env_reward = 0.0
        self.finish(slot, "stop")

    def finish(self, slot, reason: str) -> None:
        """End the episode (`reason`: its finish_reason) and close its environment."""
        slot.finish_reason = reason
        self._close(self._envs.pop(self._key(slot), None))

    def _close(self, env) -> None:
        if env is not None and not self.runner.loop.is_closed():
            # not awaited here (the episode goes on being emitted); close() waits for them all
            fut = asyncio.run_coroutine_threadsafe(_quiet_close(env, self.timeout_s), self.runner.loop)
            self._closing.add(fut)
            fut.add_done_callback(self._closing.discard)

    # -- the episode ------------------------------------------------------------------------
    async def ensure(self, slot, group, budget: int, version: int) -> None:
        """Make the slot's environment if it has none: a fresh episode is reset (its first
        observation, if any, is appended as is, stamped `version`: the engines' now); a carried
        one restored from a checkpoint is replayed turn by turn, keeping the recorded tokens.
        A failure ends the episode; so does a first observation leaving no room in `budget`."""
        if self.live(slot) or slot.done:
            return
        what = f"env {self.spec.name} (episode g{slot.gid} s{slot.index})"
        try:
            env = self.spec.factory(seed=slot.seed, **self.options)
        except Exception as err:   # noqa: BLE001 - a broken factory is the environment's error
            self._fail(slot, EnvFailure(f"{what}: cannot be made: {type(err).__name__}: {err}"))
            return
        key = self._key(slot)
        self._envs[key] = env
        try:
            first = await self._call(env.reset(group.record), f"{what} reset")
            if self._key(slot) != key:   # restarted while it reset: `prune` closes this one
                return
            if slot.turn_spans or slot.response_ids:
                await self._replay(slot, env, what)
            elif first:
                obs = self.renderer.text_ids(str(first))
                if not self._fits(slot, obs, budget, "the first observation"):
                    return
                self._append(slot, obs, version=version)
                slot.turn_base = len(slot.response_ids)
        except EnvFailure as err:
            self._fail(slot, err)

    async def _replay(self, slot, env, what: str) -> None:
        self.counts["env_replays"] += 1
        for i, (a, b) in enumerate(slot.turn_spans):
            res = _checked(await self._call(env.step(self._decode(slot.response_ids[a:b])), f"{what} replay"), what)
            nxt = slot.turn_spans[i + 1][0] if i + 1 < len(slot.turn_spans) else slot.turn_base
            again = self.renderer.ids(res.observation, slot.response_ids[b - 1] if b > a else None)
            if again != slot.response_ids[b:nxt]:
                self.counts["env_replay_mismatches"] += 1
                log.warning("%s: the replayed turn %d gives another observation than the recorded one; the "
                            "recorded tokens are kept (is the environment deterministic in record, turns, seed?)",
                            what, i)

    async def after_turn(self, slot, group, budget: int) -> None:
        """The model turn ending at the slot's last token is over: step the environment."""
        what = f"env {self.spec.name} (episode g{slot.gid} s{slot.index})"
        env = self._envs.get(self._key(slot))
        if env is None:   # made in ensure(); gone only if the episode already ended
            return
        a, b = slot.turn_base, len(slot.response_ids)
        slot.turn_spans.append([a, b])
        slot.turns += 1
        key = self._key(slot)
        try:
            res = _checked(await self._call(env.step(self._decode(slot.response_ids[a:b])), f"{what} step"), what)
        except EnvFailure as err:
            res = err
        if self._key(slot) != key:   # restarted (staleness) while it answered: the answer is void
            return
        if isinstance(res, EnvFailure):
            self._fail(slot, res)
            return
        slot.env_reward += float(res.reward)
        if res.done:
            self.finish(slot, "stop")
            return
        if slot.turns >= self.max_turns:
            self.finish(slot, "length")   # cut by env.max_turns: it did not end on its own
            return
        obs = self.renderer.ids(str(res.observation), slot.response_ids[b - 1] if b > a else None)
        if not self._fits(slot, obs, budget, f"the observation after turn {slot.turns}"):
            return
        self._append(slot, obs, version=slot.versions[-1])   # the version of the turn it answers
        slot.turn_base = len(slot.response_ids)

    def _fits(self, slot, obs: list[int], budget: int, what: str) -> bool:
        """Whether `obs` leaves room for a model token in the budget; if not the episode ends
        here, cut by the budget (its tokens stay within it; never the round's error)."""
        if len(slot.response_ids) + len(obs) < budget:
            return True
        self.counts["env_budget_ends"] += 1
        if not slot.response_ids and self.counts["env_budget_ends"] <= 3:   # nothing of it can train
            log.warning("episode g%d s%d ends cut by the token budget: %s is %d tokens, %d of "
                        "rollout.sampling.max_new_tokens=%d are left (raise it, or make the environment's "
                        "observations shorter)", slot.gid, slot.index, what, len(obs),
                        budget - len(slot.response_ids), budget)
        self.finish(slot, "length")
        return False

    @staticmethod
    def _append(slot, ids: list[int], version: int) -> None:
        slot.response_ids = slot.response_ids + list(ids)
        slot.logprobs = slot.logprobs + [0.0] * len(ids)
        slot.versions = slot.versions + [version] * len(ids)
        slot.mask = slot.mask + [0] * len(ids)

    # -- housekeeping -----------------------------------------------------------------------
    def prune(self, groups: dict) -> None:
        """Close the environments of episodes no longer open: their group was emitted or
        dropped, or the slot restarted from nothing (staleness) since it was made."""
        def stale(key) -> bool:
            gid, index, restarts = key
            g = groups.get(gid)
            return g is None or g.slots[index].restarts != restarts
        for key in [k for k in self._envs if stale(k)]:
            self._close(self._envs.pop(key))

    def take_metrics(self) -> dict:
        out = {**self.counts, "env_time_s": self.env_time_s, "env_open": len(self._envs)}
        for k in self.counts:
            self.counts[k] = 0
        self.env_time_s = 0.0
        return out

    def close(self) -> None:
        """Close every environment (each bounded by env.timeout_s), then the loop."""
        for env in list(self._envs.values()):
            self._close(env)
        self._envs.clear()
        concurrent.futures.wait(list(self._closing), timeout=self.timeout_s + 1)
        self.runner.close()


async def _quiet_close(env, timeout_s: float) -> None:
    try:
        await asyncio.wait_for(env.close(), timeout_s)
    except Exception as err:   # noqa: BLE001 - a close that fails loses nothing: logged
        log.warning("closing an environment failed: %s: %s", type(err).__name__, err)


def _checked(res, what: str) -> StepResult:
    """An environment's answer, or EnvFailure saying what is wrong with it."""
    if not isinstance(res, StepResult):
        raise EnvFailure(f"{what}: step() returned {type(res).__name__}, not a StepResult")
    try:
        reward = float(res.reward)
    except (TypeError, ValueError):
        raise EnvFailure(f"{what}: reward {res.reward!r} is not a number") from None
    if not math.isfinite(reward):
        raise EnvFailure(f"{what}: reward {reward} is not finite")
    if not isinstance(res.observation, str):
        raise EnvFailure(f"{what}: observation is {type(res.observation).__name__}, not text")
    return res


def check_environment(env, record: dict, tokenizer) -> None:
    """Before anything starts (env.* and data.prompts together): the environment can be made
    with env.options, resets on the first record of the data, and its observations can be
    rendered with this tokenizer. Later episode failures score 0 and are counted; a failure
    here would fail every episode, so it is a ConfigError naming the setting."""
    try:
        ObservationRenderer(tokenizer, env.template)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    options = dict(env.options)
    try:
        instance = env_spec(env.name).factory(seed=0, **options)
    except Exception as err:   # noqa: BLE001 - whatever the constructor raises, named
        raise ConfigError(f"env.options={options!r}: env.name={env.name} cannot be made with them "
                          f"({type(err).__name__}: {err})") from None
    runner = EnvRunner("megarl-env-check")
    try:
        runner.run(instance.reset(record), env.timeout_s)
    except concurrent.futures.TimeoutError:
        raise ConfigError(f"env.timeout_s={env.timeout_s}: env.name={env.name} did not reset on the first record "
                          f"of data.prompts within it: raise env.timeout_s") from None
    except Exception as err:   # noqa: BLE001 - the environment's own error, named
        raise ConfigError(f"env.name={env.name}: reset(the first record of data.prompts) failed "
                          f"({type(err).__name__}: {err}): does data.prompts hold this environment's "
                          f"records?") from None
    finally:
        try:
            runner.run(instance.close(), env.timeout_s)
        except Exception:   # noqa: BLE001 - a close that fails changes no verdict
            pass
        runner.close()
