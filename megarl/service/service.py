"""Rollout as a service: outside agents run episodes against the policy over HTTP.

An agent (any program speaking the OpenAI chat API) opens an episode (`POST /v1/episodes`:
its task, a record of the run's data stream), talks to the policy through
`/v1/chat/completions` as often as it likes, and ends the episode with a reward. Every call
goes to the engine pool, and the episode's tokens are recorded exactly as the engine saw them
(megarl/service/recorder.py), so the trainer gets one Sample per episode with its loss mask.

Groups: each record is handed out `n` times (the first n episode starts get record A, the next
n record B, ...); a group is complete when its n episodes have a reward, and `take_groups(k)`
hands complete groups to the trainer, oldest first. An episode cancelled by the agent or
timed out (no call for `episode_timeout_s`) is not trained: its place in the group is handed
out again to the next episode start, before any new record, so every group can complete.

Everything runs on the pool's event loop (the `LoopThread` of megarl/rollout/engines/pool.py): the
HTTP server (uvicorn) is a task there, and handlers call the pool directly. Weight updates:
the service is one of the pool's `holders`, so no engine request starts while one is under
way; with rollout.update_mode=abort a call's request aborted by an update is sent again with
its tokens so far appended (each token keeps the version it was sampled under), with keep the
engines hold it over the update themselves.

Bounds and answers: every call's prompt must fit the engines' context (rollout.engines.max_model_len;
the recorder refuses one that does not, 400, and cuts a completion to what is left); a call the
engine refuses as invalid is answered 400 with the engine's message (the engine stays in
service, the episode is unchanged); an engine failure is a 503 that names no engine (its URL and
log are in the trainer's log, not for agents). Request bodies are bounded by the app
(service.max_request_mb, 413), and complete groups waiting for the trainer by
service.max_ready_groups: past it new episodes get 429 until a step takes some. What a step
takes keeps the staleness bound, rollout.partial.max_staleness (megarl/service/bound.py).
"""
from __future__ import annotations

import asyncio
import logging
import math
import socket
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Optional

from megarl.data.sample import Sample
from megarl.data.seeds import group_seed, request_seed, sample_seed
from megarl.envs.render import ObservationRenderer
from megarl.rollout import routes as route_rows
from megarl.rollout.engines.engine import EngineError, GenRequest, GenResult, RequestError
from megarl.service.bound import discard_stale
from megarl.service.groups import Group, GroupBook
from megarl.service.recorder import ENGINE_FAILED, EpisodeRecorder, ServiceError, Turn

log = logging.getLogger("megarl.service")
STATE_FORMAT = 1
ENDED_KEPT = 4096          # ended episode ids remembered, so a late call learns why it is refused


@dataclass
class Episode:
    id: str
    group: Group
    slot: int
    recorder: EpisodeRecorder
    last: float                    # monotonic time of the last call's end (or of the start)
    busy: bool = False             # a call is being served
    inflight: bool = False         # an engine request of that call is on the pool
    ended: str = ""                # why it ended: finished | cancelled | timed_out | closed


@dataclass
class Reply:
    """What one chat call produced, for the HTTP answer."""
    episode_id: str
    call: int
    content: str
    token_ids: list[int]
    tokens: list[str]              # each token's text (the logprobs' `token`)
    logprobs: list[float]
    finish_reason: str             # stop | length
    prompt_tokens: int


def _check(setting: str, value, ok: bool, rule: str) -> None:
    if not ok:
        raise ValueError(f"{setting}={value!r}: {rule}")


class AgentService:
    """The agent-facing rollout service on `pool`'s event loop (module docstring).

    State (`state_dict`): the groups not yet taken (complete ones and partly rewarded ones)
    and the hand-out position. Open episodes are not saved: after a crash or a restore their
    agents' calls are refused (unknown episode), their slots are handed out again, and they
    are counted (`agent_episodes_lost`)."""

    def __init__(self, pool, tokenizer, *, next_task: Callable[[], tuple[dict, int]], n: int, api_key: str,
                 host: str = "127.0.0.1", port: int = 0, max_episodes: int = 64, max_new_tokens: int = 1024,
                 max_model_len: int, temperature: float = 1.0, top_p: float = 1.0, top_k: int = -1,
                 seed: Optional[int] = None,
                 episode_timeout_s: float = 600.0, model_name: str = "megarl-policy",
                 max_request_bytes: int = 16 << 20, max_ready_groups: int = 64, max_requests: int = 128):
        _check("rollout.sampling.n", n, isinstance(n, int) and n >= 1, "episodes per record must be an integer >= 1")
        _check("service.api_key", "***" if api_key else api_key, bool(api_key),
               "the service needs an API key (anyone reaching the port could otherwise steer the run)")
        _check("service.max_episodes", max_episodes, max_episodes >= 1, "must be >= 1")
        _check("rollout.sampling.max_new_tokens", max_new_tokens, max_new_tokens >= 1, "must be >= 1")
        _check("rollout.engines.max_model_len", max_model_len, isinstance(max_model_len, int) and max_model_len >= 2,
               "must be an integer >= 2 (the engines' context: a prompt and at least one completion token)")
        _check("service.max_request_mb", max_request_bytes / (1 << 20), max_request_bytes >= 1024, "must be >= 0.001")
        _check("service.max_ready_groups", max_ready_groups, max_ready_groups >= 1, "must be >= 1")
        _check("service.max_requests", max_requests, max_requests >= 1, "must be >= 1")
        _check("rollout.sampling.temperature", temperature, temperature > 0,
               "must be > 0: agent episodes are sampled, and PPO needs their behaviour logprobs")
        _check("service.episode_timeout_s", episode_timeout_s, episode_timeout_s > 0, "must be > 0")
        _check("service.port", port, 0 <= port < 65536, "0 (a free port) or a port number")
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("the agent service renders chat messages with the tokenizer's chat template, and this "
                             "tokenizer has none: use a chat model, or set one on its tokenizer_config.json")
        self.pool, self.tokenizer, self.renderer = pool, tokenizer, ObservationRenderer(tokenizer, "chat")
        self.api_key, self.host, self.port, self.model_name = api_key, host, port, model_name
        self.n, self.max_episodes, self.max_new_tokens = n, max_episodes, max_new_tokens
        self.max_model_len, self.max_request_bytes, self.max_ready_groups = max_model_len, max_request_bytes, \
            max_ready_groups
        self.temperature, self.seed, self.episode_timeout_s = temperature, seed, episode_timeout_s
        self.top_p, self.top_k = top_p, top_k     # rollout.sampling's cut, on every request
        self.max_requests = max_requests     # requests served at once (app.Guard)
        self.book = GroupBook(n, next_task)
        self.episodes: dict[str, Episode] = {}
        self.ended: OrderedDict[str, str] = OrderedDict()   # recently ended id -> why
        self.finished: dict[str, Sample] = {}               # rewarded, until their group is taken
        self.counts = dict.fromkeys(("started", "finished", "cancelled", "timed_out", "lost", "calls",
                                     "continuations", "turns", "observation_tokens", "stale_restarted",
                                     "stale_dropped", "stale_tokens"), 0)
        self._open = asyncio.Event()        # clear while a weight update holds the service
        self._open.set()
        self._changed = asyncio.Event()     # a group completed
        self._server = self._serving = self._reaper = None

    # -- lifecycle -----------------------------------------------------------------------------
    @property
    def url(self) -> str:
        """The service's base URL (after start(): the port actually bound)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def _listen(self) -> socket.socket:
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((self.host, self.port))
        except OSError as err:
            sock.close()
            raise RuntimeError(f"service.host={self.host!r} service.port={self.port}: cannot listen there ({err}); "
                               f"free the port or set service.port=0 (any free port)") from err
        self.port = sock.getsockname()[1]
        return sock

    async def start(self) -> None:
        """Serve the app on the running loop (the pool's); returns once it accepts connections."""
        import uvicorn  # here: only a run in service mode needs the web stack

        from megarl.service.app import create_app
        sock = self._listen()     # bound here, so a busy port is an error here, not a SystemExit in a task
        self._server = uvicorn.Server(uvicorn.Config(create_app(self), host=self.host, port=self.port,
                                                     log_level="warning", lifespan="off",
                                                     timeout_graceful_shutdown=5))
        self._serving = asyncio.ensure_future(self._server.serve(sockets=[sock]))
        while not self._server.started:
            if self._serving.done():
                sock.close()
                self._serving.result()     # its error, if it failed
                raise RuntimeError(f"the agent service on {self.url} stopped while starting")
            await asyncio.sleep(0.01)
        self.pool.holders.append(self)
        self._reaper = asyncio.ensure_future(self._reap())

    async def close(self) -> None:
        """Stop serving; open episodes end (counted as cancelled), their requests aborted."""
        if self in self.pool.holders:
            self.pool.holders.remove(self)
        if self._reaper is not None:
            self._reaper.cancel()
            await asyncio.gather(self._reaper, return_exceptions=True)
        for ep in list(self.episodes.values()):
            await self._drop(ep, "closed")
        self._open.set()
        if self._serving is not None:
            self._server.should_exit = True
            await asyncio.gather(self._serving, return_exceptions=True)
        self._server = self._serving = self._reaper = None

    # -- the pool's weight updates (EnginePool.holders) ------------------------------------------
    async def hold(self) -> None:
        """No engine request starts until release() (abort mode: the pool then aborts what runs,
        and each call continues its request after the update)."""
        self._open.clear()

    def release(self) -> None:
        self._open.set()

    # -- episodes ------------------------------------------------------------------------------
    def open_episode(self) -> dict:
        if len(self.episodes) >= self.max_episodes:
            raise ServiceError(429, f"{len(self.episodes)} episodes are open (service.max_episodes="
                                    f"{self.max_episodes}): end one with a reward or cancel it, or retry later")
        ready = len(self.book.complete())
        if ready >= self.max_ready_groups:
            raise ServiceError(429, f"{ready} complete groups are waiting for the trainer (service.max_ready_groups="
                                    f"{self.max_ready_groups}): retry after its next step takes them", "groups_waiting")
        group, slot = self.book.hand_out()
        eid = f"ep-{uuid.uuid4().hex}"
        recorder = EpisodeRecorder(eid, self.renderer, self.max_new_tokens, self.max_model_len)
        self.episodes[eid] = Episode(eid, group, slot, recorder, time.monotonic())
        self.counts["started"] += 1
        return {"episode_id": eid, "group": group.serial, "index": slot, "task": group.record}

    def _live(self, episode_id: str) -> Episode:
        ep = self.episodes.get(episode_id)
        if ep is not None:
            return ep
        why = self.ended.get(episode_id)
        if why is not None:
            return self._refuse_ended(episode_id, why)
        raise ServiceError(404, f"no episode {episode_id!r}: start one with POST /v1/episodes "
                                f"(episodes open before a service restart are lost)", "episode_not_found")

    def _refuse_ended(self, episode_id: str, why: str):
        detail = {"timed_out": f"no call for service.episode_timeout_s={self.episode_timeout_s:g} s",
                  "finished": "it has its reward", "cancelled": "it was cancelled",
                  "closed": "the service stopped"}.get(why, why)
        raise ServiceError(409, f"episode {episode_id} has ended ({detail}): start a new one", "episode_ended")

    def _end(self, ep: Episode, why: str) -> None:
        ep.ended = why
        self.episodes.pop(ep.id, None)
        self.ended[ep.id] = why
        while len(self.ended) > ENDED_KEPT:
            self.ended.popitem(last=False)

    async def _drop(self, ep: Episode, why: str) -> None:
        """End `ep` untrained: its slot is handed out again, its request (if any) aborted."""
        self._end(ep, why)
        self.book.give_back(ep.group, ep.slot)
        self.counts["timed_out" if why == "timed_out" else "cancelled"] += 1
        if ep.inflight:
            await self.pool.abort([self._key(ep)])

    async def cancel(self, episode_id: str) -> dict:
        ep = self._live(episode_id)
        await self._drop(ep, "cancelled")
        return {"episode_id": episode_id, "cancelled": True}

    async def reward(self, episode_id: str, reward) -> dict:
        """End an episode with its reward; its group may now be complete."""
        ep = self._live(episode_id)
        if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
            raise ServiceError(400, f"reward={reward!r}: send a finite number, as {{\"reward\": 1.0}}")
        if ep.busy:
            raise ServiceError(409, f"episode {episode_id}: a chat call is still being served; reward it after "
                                    f"the answer", "call_in_flight")
        if ep.recorder.calls == 0:
            raise ServiceError(409, f"episode {episode_id} has no model call to train on: cancel it instead",
                               "no_calls")
        g = ep.group
        sample = ep.recorder.to_sample(reward, g.serial, g.record, g.uid)
        self._end(ep, "finished")
        self.finished[ep.id] = sample
        self.counts["finished"] += 1
        self.counts["turns"] += ep.recorder.calls
        self.counts["observation_tokens"] += ep.recorder.observation_tokens
        complete = self.book.finish(g, ep.slot, sample)
        if complete:
            self._changed.set()
        return {"episode_id": episode_id, "group": g.serial, "group_complete": complete}

    def trajectory(self, episode_id: str) -> dict:
        """The recorded tokens of an open or rewarded (not yet taken) episode."""
        if episode_id in self.finished:
            s = self.finished[episode_id]
            return {"episode_id": episode_id, "state": "finished", "reward": s.reward, "prompt_ids": s.prompt_ids,
                    "response_ids": s.response_ids, "mask": s.mask, "logprobs": s.logprobs,
                    "versions": s.versions, "turns": s.turns, "finish_reason": s.finish_reason}
        ep = self._live(episode_id)
        return {"episode_id": episode_id, "state": "open", **ep.recorder.trajectory()}

    # -- chat calls ----------------------------------------------------------------------------
    @staticmethod
    def _key(ep: Episode) -> str:
        return f"agent-{ep.id}-{ep.recorder.calls}"

    def _request_seed(self, ep: Episode, tokens: int, restarts: int) -> Optional[int]:
        """Per-request seed from service.seed, the record's number, the slot and how far the
        episode got: a rerun of the same episode draws the same tokens."""
        if self.seed is None:
            return None
        uid = ep.group.uid if ep.group.uid >= 0 else ep.group.serial
        return request_seed(sample_seed(group_seed(self.seed, uid), ep.slot), tokens, restarts)

    async def _generate(self, ep: Episode, turn: Turn) -> GenResult:
        """The call's completion: sent again after an abort (a weight update in abort mode)
        with what it had, until the engine stops or the budget ends it."""
        prompt, got, restarts = turn.engine_prompt, GenResult(self._key(ep)), 0
        done_before = len(ep.recorder.response_ids) + len(turn.context_ids)
        while not ep.ended:
            await self._open.wait()
            if ep.ended:
                break
            req = GenRequest(got.key, prompt + got.token_ids, turn.max_tokens - len(got.token_ids),
                             self.temperature, top_p=self.top_p, top_k=self.top_k,
                             seed=self._request_seed(ep, done_before + len(got.token_ids), restarts))
            ep.inflight = True
            try:
                res = await self.pool.generate(req)
            finally:
                ep.inflight = False
            # routing replay: this request's rows cover its whole input; the ones already held stay
            got.routes = route_rows.continued(got.routes, len(got.token_ids), len(prompt), res.routes)
            got.token_ids += res.token_ids
            got.logprobs += res.logprobs
            got.versions += res.versions
            got.engine = res.engine
            if res.finish_reason != "abort":
                got.finish_reason = res.finish_reason
                break
            if len(got.token_ids) >= turn.max_tokens:
                got.finish_reason = "length"
                break
            restarts += 1
            self.counts["continuations"] += 1
        return got

    async def chat(self, episode_id: str, messages, max_tokens: Optional[int] = None) -> Reply:
        """One chat completion of an episode, recorded token-exactly."""
        ep = self._live(episode_id)
        if ep.busy:
            raise ServiceError(409, f"episode {episode_id}: a chat call is already being served; an episode's "
                                    f"calls are sequential (send the next one after its answer)", "call_in_flight")
        turn = ep.recorder.prepare(messages, max_tokens)
        ep.busy = True
        try:
            got = await self._generate(ep, turn)
        except RequestError as err:      # the call's own error: the engine is fine, the agent hears why
            raise ServiceError(400, f"episode {episode_id}: the policy's engine refused this call: {err}",
                               "request_refused") from err
        except EngineError as err:
            log.warning("megarl: agent call of episode %s failed on the engines: %s", episode_id, err)
            raise ServiceError(503, f"episode {episode_id}: {ENGINE_FAILED}") from err
        finally:
            ep.busy, ep.last = False, time.monotonic()
        if ep.ended:
            self._refuse_ended(episode_id, ep.ended)
        content = self.tokenizer.decode(got.token_ids, skip_special_tokens=True)
        call = ep.recorder.calls
        ep.recorder.commit(turn, got.token_ids, got.logprobs, got.versions, got.finish_reason, content, got.routes)
        self.counts["calls"] += 1
        return Reply(episode_id, call, content, list(got.token_ids),
                     [self.tokenizer.decode([t]) for t in got.token_ids], list(got.logprobs), got.finish_reason,
                     len(turn.engine_prompt))

    # -- timeouts ------------------------------------------------------------------------------
    def idle(self, now: float) -> list[Episode]:
        """Open episodes with no call for episode_timeout_s (one being served is not idle)."""
        return [ep for ep in self.episodes.values() if not ep.busy and now - ep.last >= self.episode_timeout_s]

    async def _reap(self) -> None:
        every = min(1.0, self.episode_timeout_s / 4)
        while True:
            await asyncio.sleep(every)
            for ep in self.idle(time.monotonic()):
                await self._drop(ep, "timed_out")

    # -- the trainer's side --------------------------------------------------------------------
    async def take_groups(self, k: int, stale: Optional[Callable[[Sample], bool]] = None,
                          drop_stale: bool = False) -> list[list[Sample]]:
        """Wait for k complete groups; hand them over, oldest first (see GroupBook.take).
        `stale(sample)`: the staleness bound (megarl/service/bound.py): a rewarded sample past it
        is not handed over; its place is handed out again (`drop_stale`: its group dropped)."""
        if k > self.max_ready_groups:   # new episodes would be refused before k groups are complete
            raise ValueError(f"train.groups_per_step={k} is more than service.max_ready_groups="
                             f"{self.max_ready_groups}: raise service.max_ready_groups to at least {k}")
        while True:
            if stale is not None:
                lost = discard_stale(self.book, stale, drop_stale)
                for key, n in (("stale_restarted", lost.restarted), ("stale_dropped", lost.dropped),
                               ("stale_tokens", lost.tokens)):
                    self.counts[key] += n
            if len(self.book.complete()) >= k:
                break
            self._changed.clear()
            await self._changed.wait()
        groups = self.book.take(k)
        # the stored samples keep the service's group serial (take() hands out renumbered copies)
        for eid in [e for e, s in self.finished.items() if s.group not in self.book.groups]:
            del self.finished[eid]
        return groups

    def metrics(self) -> dict:
        c, finished = self.counts, max(1, self.counts["finished"])
        return {"agent_episodes_started": c["started"], "agent_episodes_finished": c["finished"],
                "agent_episodes_cancelled": c["cancelled"], "agent_episodes_timed_out": c["timed_out"],
                "agent_episodes_lost": c["lost"], "agent_calls": c["calls"],
                "agent_continuations": c["continuations"], "agent_turns_per_episode": c["turns"] / finished,
                "agent_observation_tokens": c["observation_tokens"], "agent_open_episodes": len(self.episodes),
                "agent_groups_ready": len(self.book.complete()), "agent_stale_restarted": c["stale_restarted"],
                "agent_stale_groups_dropped": c["stale_dropped"], "agent_stale_tokens_discarded": c["stale_tokens"]}

    def state_dict(self) -> dict:
        """Untaken groups (their rewarded samples) and the hand-out position; the open episodes
        are only counted: they are lost on a crash (class docstring)."""
        return {"format": STATE_FORMAT, "open_episodes": len(self.episodes), **self.book.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if state.get("format") != STATE_FORMAT:
            raise ValueError(f"agent service state of format {state.get('format')!r}; this megarl reads "
                             f"format {STATE_FORMAT}")
        if self.episodes:
            raise RuntimeError("load_state_dict with episodes open: restore before agents connect")
        self.counts["lost"] += self.book.load_state_dict(state)
        self.finished = {}
        if self.book.complete():
            self._changed.set()
