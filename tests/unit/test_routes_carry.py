"""Routing replay through the partial-rollout controller: each sample's routes hold, for every
token fed, the experts of the weights that produced the token after it, across carry-over
(keep: requests held over weight updates; abort: continuations sent as new requests), engine
failures, checkpoints and resume.

The scripted engine stamps each row with the version it computed it under and its position:
a continuation re-feeds its earlier tokens under the new version, so a row taken from it where
the earlier request's row should stay shows as a wrong version."""
import asyncio
import copy
import json

import numpy as np
import pytest
import test_controller as tc
from scripted_engine import Clock, ScriptedEngine

from megarl.rollout import routes
from megarl.rollout.controller.slots import Group, Slot, group_from_state, group_state, set_tokens
from megarl.rollout.engines.engine import EngineError, GenRequest
from megarl.rollout.engines.pool import EnginePool


def script_routes(prompt_len: int, versions: list[int], first_version: int) -> np.ndarray:
    """Rows of a request: [version that computed it, position]; the prompt's rows come from the
    request's first step, each later row from the step that produced the token after it."""
    n = routes.expected_rows(prompt_len, len(versions))
    rows = np.zeros((n, 1, 2), np.uint8)
    for q in range(n):
        rows[q, 0] = (versions[q + 1 - prompt_len] if q + 1 >= prompt_len else first_version, q % 256)
    return rows


class Routed:
    """Routes on a scripted engine's results (as a real engine returns them once asked), also
    on the partial result a failing request hands back."""
    routes = True

    async def generate(self, req):
        self.__dict__.setdefault("_asked", {})[req.key] = len(req.prompt_ids)
        try:
            res = await super().generate(req)
        except EngineError as err:
            self._routed(req.key, err.partial)
            raise
        return self._routed(req.key, res)

    def _routed(self, key, res):
        if res is not None:
            first = res.versions[0] if res.versions else self.version
            res.routes = script_routes(self._asked[key], res.versions, first)
        return res

    def partial(self, key):
        """As the real engines: rows read at a pause; a running request's partial has none."""
        return self._routed(key, super().partial(key)) if self.paused else super().partial(key)


class RoutedKeyedEngine(Routed, tc.KeyedEngine):
    """The controller tests' engine, with routes."""


class RoutedDyingEngine(Routed, tc.DyingKeyedEngine):
    """The controller tests' dying engine, with routes."""


def check_routes(samples) -> int:
    """Every row is the one that produced the token after it. Returns the samples checked."""
    for s in samples:
        p = len(s.prompt_ids)
        assert s.routes is not None, f"sample of group {s.uid}: no routes"
        assert s.routes.shape == (p + len(s.response_ids) - 1, 1, 2)
        assert s.routes[:, 0, 1].tolist() == [q % 256 for q in range(len(s.routes))]
        want = [s.versions[q + 1 - p] if q + 1 >= p else s.versions[0] for q in range(len(s.routes))]
        got = s.routes[:, 0, 0].tolist()
        assert got == want, f"group {s.uid}: rows' versions {got} != the versions of the tokens they produced {want}"
    return len(samples)


def trained_samples(trained) -> list:
    return [s for _, groups in trained for g in groups for s in tc.PartialRolloutController.samples_of(g)]


@pytest.fixture
def routed(monkeypatch):
    monkeypatch.setattr(tc, "KeyedEngine", RoutedKeyedEngine)
    monkeypatch.setattr(tc, "DyingKeyedEngine", RoutedDyingEngine)


@pytest.mark.parametrize("update_mode,keep_kv", [("abort", False), ("keep", False), ("keep", True)])
def test_carried_samples_keep_the_routes_of_the_weights_that_produced_each_token(routed, update_mode, keep_kv):
    _, trained, metrics, _ = tc.run(tc.drive(6, update_mode=update_mode, keep_kv=keep_kv))
    samples = trained_samples(trained)
    assert check_routes(samples) == 6 * 3 * 4
    assert any(len(set(s.versions)) > 1 for s in samples), "no sample spanned a weight update"


def test_an_engine_dying_mid_request_keeps_the_routes_it_served(routed):
    """The pool continues a failed engine's request elsewhere from its tokens: their rows are
    the failed engine's, the rest the new engine's."""
    _, trained, _, _ = tc.run(tc.drive(4, die_at=25))
    assert check_routes(trained_samples(trained)) == 4 * 3 * 4


def test_state_saved_with_requests_in_flight_resumes_with_their_routes(routed):
    """Keep mode: a checkpoint taken while held requests run saves each slot's routes so far
    (plain data: the checkpoint pickles it); a controller restored from it trains samples whose
    every row is still the one that produced its token."""
    saved = {}

    async def snapshot(ctl, version):
        for _ in range(3):
            await ctl.pool.engines[0].clock.tick()
        if version == 3:
            await ctl.hold(scoring=True)
            assert ctl._inflight, "the checkpoint must be taken with requests in flight"
            saved["state"] = json.loads(json.dumps(ctl.state_dict()))   # plain data only
            saved["rows"] = {(s.gid, s.index): len(s.routes) for s in ctl._inflight.values() if s.routes is not None}
            ctl.release()
    _, part1, _, _ = tc.run(tc.drive(3, update_mode="keep", between=snapshot))
    assert saved["rows"], "no held request had routes at the checkpoint"
    restored = {(g["gid"], s["index"]): s["routes"] for g in saved["state"]["open"] for s in g["slots"]}
    assert all(routes.from_state(restored[k]).shape[0] == n for k, n in saved["rows"].items())
    _, part2, _, _ = tc.run(tc.drive(3, state=copy.deepcopy(saved["state"]), start_version=3, update_mode="keep"))
    check_routes(trained_samples(part1))
    assert check_routes(trained_samples(part2)) == 3 * 3 * 4


def test_a_held_requests_partial_carries_its_routes_once_paused():
    """pool.partial of a request held by a pause: every row of the tokens it has so far."""
    async def main():
        clock = Clock()
        clock.start()
        engine = RoutedKeyedEngine("e0", clock)
        pool = EnginePool([engine], 30, update_mode="keep")
        task = asyncio.ensure_future(pool.generate(GenRequest("g0s0a0", [7, 7], 64)))
        while engine.partial("g0s0a0") is None or len(engine.partial("g0s0a0").token_ids) < 3:
            await clock.tick()
        await pool.pause_all()
        part = pool.partial("g0s0a0")
        await pool.resume_all()
        done = await task
        clock.stop()
        return part, done
    part, done = asyncio.run(main())
    assert part.routes.shape[0] == 2 + len(part.token_ids) - 1
    assert np.array_equal(done.routes[:len(part.routes)], part.routes)


def test_an_episode_observation_gets_rows_from_the_request_that_feeds_it():
    """Multi-turn: observation tokens are appended without a request; the next model turn's
    request feeds them (context), so their rows, and the last model token's, come from it."""
    slot = Slot(0, 0, 0)
    prompt = [5, 6, 7]
    first = ScriptedResult(prompt, [10, 11], version=0)
    set_tokens(slot, 0, first, episode=True, prompt_len=3)
    slot.response_ids += [90, 91]          # the environment's observation (rows: not yet)
    slot.logprobs += [0.0, 0.0]
    slot.versions += [0, 0]
    slot.mask += [0, 0]
    second = ScriptedResult(prompt + slot.response_ids, [12], version=1)
    set_tokens(slot, 4, second, episode=True, prompt_len=3)
    g = Group(0, {}, prompt, [slot])
    rows = tc.PartialRolloutController.samples_of(g)[0].routes
    assert rows.shape[0] == 3 + 5 - 1
    # rows 0..3 from the first request (the prompt and its first token: version 0), the rest
    # (its last token, the observation) fed by the second request
    assert rows[:, 0, 0].tolist() == [0, 0, 0, 0, 1, 1, 1]
    again = group_from_state(json.loads(json.dumps(group_state(g))))
    assert np.array_equal(again.slots[0].routes, slot.routes)


class ScriptedResult:
    """A GenResult-like result of a request with `prompt` producing `tokens` under `version`."""

    def __init__(self, prompt, tokens, version):
        self.token_ids, self.logprobs, self.versions = list(tokens), [0.0] * len(tokens), [version] * len(tokens)
        self.routes = np.stack([np.full((1, 2), version, np.uint8)] * routes.expected_rows(len(prompt), len(tokens)))


def test_join_keeps_earlier_rows_and_refuses_short_ones():
    old = np.zeros((4, 1, 2), np.uint8)
    new = np.ones((7, 1, 2), np.uint8)
    assert routes.join(old, new, 4)[:, 0, 0].tolist() == [0, 0, 0, 0, 1, 1, 1]
    assert routes.join(old, None, 4)[:, 0, 0].tolist() == [0, 0, 0, 0]
    assert routes.fit(routes.join(old, None, 4), 6) is None        # rows missing: no routes
    assert routes.continued(None, 0, 3, new) is new                 # nothing served: the new request's


def test_route_bytes_counts_the_trained_samples_routes():
    s = [type("S", (), {"routes": np.zeros((5, 2, 2), np.uint8), "response_ids": [1]})(),
         type("S", (), {"routes": None, "response_ids": [1]})()]
    assert routes.metrics(s) == {"route_bytes": 20, "samples_without_routes": 1}
    assert routes.metrics([s[1]]) == {}


def test_unused_engine_class_is_not_routed():
    assert ScriptedEngine.routes is False


def _routed_sample(n_prompt=3, n_resp=4):
    from megarl.data.sample import Sample
    rows = np.arange((n_prompt + n_resp - 1) * 4, dtype=np.uint8).reshape(-1, 2, 2)
    return Sample([1] * n_prompt, [5] * n_resp, [0.0] * n_resp, [0] * n_resp, True, 0, routes=rows,
                  old_logprobs=[0.0] * n_resp)


def test_checkpointed_samples_keep_their_routes(tmp_path):
    """The lag queue's samples and a controller's slots go into driver.pt, which is loaded with
    torch.load(weights_only=True): their routes must be plain data and come back equal."""
    import torch

    from megarl.rollout.controller.lag import LagQueue
    q = LagQueue(1)
    s = _routed_sample()
    q.put([s], {})
    torch.save({"lag": q.state_dict(), "slot": group_state(Group(0, {}, [1, 2], [Slot(0, 0, 0, routes=s.routes)]))},
               tmp_path / "driver.pt")
    back = torch.load(tmp_path / "driver.pt", weights_only=True)
    q2 = LagQueue(1)
    q2.load_state_dict(back["lag"])
    assert np.array_equal(q2.rounds[0][0][0].routes, s.routes)
    assert np.array_equal(group_from_state(back["slot"]).slots[0].routes, s.routes)


def test_dumped_samples_keep_their_routes(tmp_path):
    from megarl.rollout.controller.dump import dump_samples, read_samples
    tok = type("T", (), {"decode": staticmethod(lambda ids, skip_special_tokens=False: " ".join(map(str, ids)))})()
    s = _routed_sample()
    path = dump_samples(str(tmp_path), 1, [s], tok)
    back = read_samples(path)
    assert np.array_equal(back[0].routes, s.routes) and back[0].routes.dtype == np.uint8


def test_usable_rows_cover_every_position_a_trained_token_depends_on():
    """rollout/routes.usable: all of a sample's rows, or fewer when they still hold the first
    `need` (Sample.routes_needed: the positions before its last trained token); None when not."""
    rows = np.arange(7, dtype=np.uint8).reshape(-1, 1, 1)
    assert routes.usable(rows, 6, 6).shape[0] == 6                  # every input token: cut to them
    assert routes.usable(rows[:4], 6, 4).shape[0] == 4              # short, the rest trains nothing
    assert routes.usable(rows[:3], 6, 4) is None                    # a trained token lacks its rows
    assert routes.usable(None, 6, 0) is None and routes.usable(None, 6, 1) is None


class Unprefilled(Routed):
    """Routed, but a request held before its first token has no rows yet: the real engines
    capture a prompt's rows in the prefill step that produces its first token."""

    def _routed(self, key, res):
        res = super()._routed(key, res)
        if res is not None and not res.token_ids:
            res.routes = None
        return res


def _routed_turn_engine():
    import test_episodes as te

    class RoutedTurnEngine(Unprefilled, te.TurnEngine):
        """The episode tests' engine, with routes."""
    return te, RoutedTurnEngine


@pytest.mark.parametrize("update_mode", ["abort", "keep"])
def test_the_carry_of_episodes_between_turns_has_routes_for_every_trained_token(monkeypatch, update_mode):
    """An episode carried between turns (its observation appended, the next model turn not
    fed to an engine yet; in keep mode also one whose next turn is held before its prefill)
    has no rows for its observation: the l_old pass of the carry (RoundStepper.pending) gets
    rows for every position before its last model token, and the samples carry their loss
    mask, so routing replay fills the rest (ppo/route_layout.batch_routes) instead of
    refusing. Each carried row is the one the episode trains with later."""
    from megarl.data.sample import Sample
    from megarl.ppo.route_layout import batch_routes
    from megarl.rollout.controller.rounds import RoundStepper
    te, engine = _routed_turn_engine()
    monkeypatch.setattr(te, "TurnEngine", engine)
    seen = {"short": 0, "held_unfed": 0, "rows": {}}

    def on_round(ctl, version):
        seen["held_unfed"] += sum(len(s.response_ids) == s.turn_base and s.turns > 0 and len(s.routes) <
                                  routes.expected_rows(len(te.PROMPT), len(s.response_ids))
                                  for s in ctl._inflight.values())
        stepper = RoundStepper(ctl, 2, False)
        pending = stepper.pending()
        for slot, _, length, s in pending:
            assert s.mask == slot.mask[:length], "the carry's samples carry their loss mask"
            assert s.routes is not None and len(s.routes) >= s.routes_needed, (slot.gid, slot.index)
            seen["short"] += len(s.routes) < routes.expected_rows(len(s.prompt_ids), len(s.response_ids))
            seen["rows"][(slot.gid, slot.index, slot.restarts)] = s.routes.copy()
        samples = [s for *_, s in pending]
        if samples:
            longest = max(len(s.prompt_ids) + len(s.response_ids) for s in samples)
            assert batch_routes(samples, longest) is not None
        stepper.store([[0.0] * length for _, _, length, _ in pending])
    _, trained, metrics, _ = asyncio.run(te.drive(8, update_mode=update_mode, on_round=on_round))
    assert sum(m["episodes_carried_between_turns"] for m in metrics) > 0
    assert seen["short"] > 0, "no carried episode lacked the rows of its observation"
    if update_mode == "keep":
        assert seen["held_unfed"] > 0, "no next turn was held before its prefill at a round's end"
    final = {(g.gid, s.index, s.restarts): Sample(g.prompt_ids, s.response_ids, [], [], True, 0, routes=s.routes)
             for _, groups in trained for g in groups for s in g.slots}
    later = [k for k in seen["rows"] if k in final]
    assert later
    for k in later:
        rows = seen["rows"][k]
        assert np.array_equal(final[k].routes[:len(rows)], rows), k
