"""The engine protocol: one async, request-level interface for every rollout engine.

Implementations: `vllm_async.AsyncVLLMEngine` (vLLM `AsyncLLM`, engine core in its own
process), `vllm_http.HTTPVLLMEngine` (a vLLM OpenAI-compatible server, remote, or local as
`servers.LocalServerEngine`), the simulator's `megarl.sim.engine.SimEngine`, and scripted
engines in unit tests. The pool, the controller and the synchronous rollout only see this.
tests/engine_contract.py checks the contract below on every kind.

Contract (what PPO and the pool rely on):
- Behaviour logprobs: `GenResult.logprobs[i]` is the log probability of `token_ids[i]` under
  the distribution the engine sampled it from, after temperature: at top_p=1 and top_k=-1,
  log_softmax(logits / temperature) of the weights that produced it, else the same over the
  top-k / top-p set renormalised (models/sampling_cut.py) (vLLM: servers and
  engines run with logprobs_mode=processed_logprobs; raw logprobs would make every
  importance ratio wrong at temperature != 1). PPO's ratios and the weight-sync check
  (`weight_sync.verify`) compare them with the trainer's own log_softmax(logits / T).
- Versions: every token carries the version that produced it: the engine, not the trainer,
  stamps each token with the weight version it was sampled under (`versions`, aligned with
  `token_ids`; vLLM reports the spans itself, and they win over the client's stamps). Weights
  arrive only while the engine is paused; a request held over an update
  (rollout.update_mode=keep) goes on under the new version after `resume()`, so its tokens
  span both. With update_mode=abort the pool aborts everything first, and a sample it
  continues after the update keeps each token's own version.
- `generate(req)` resolves exactly once, with every token the engine produced for it; the
  lists `token_ids`, `logprobs` and `versions` have one entry per generated token, at most
  `max_tokens` of them. `finish_reason` is "stop" (EOS or a stop token), "length" (the token
  budget ran out; always so with `ignore_eos`) or "abort". `GenResult.stopped` is
  finish_reason == "stop": only such a response ended on its own; one cut by the budget or
  an abort did not (the verifier is told whether it stopped; partial rollout continues an aborted one).
- Abort: an aborted request resolves with finish_reason "abort" and the tokens and logprobs
  streamed so far (a request that had already ended keeps its own reason); it never raises
  for an abort. `abort(keys)` / `abort()` (all) returns only after every aborted `generate`
  has resolved; keys not running are ignored. `running` is then 0 for them.
- Pause: `pause()` stops scheduling; running requests are held, not aborted, and go on after
  `resume()`. Once pause() returned, `partial(key)` of a held request is every token it has
  produced (nothing more arrives before resume()).
- Progress: `partial(key)` is a copy of what the in-flight request `key` has streamed so far
  (tokens, logprobs, versions: a prefix of its final result), None when it is not in flight.
- KV over an update: after new weights loaded into a paused engine holding requests,
  `clear_kv()` drops their KV (and the prefix cache) so they recompute it under the new
  weights when they resume (rollout.keep_kv=false); without it they keep the KV computed
  under the old weights.
- Weights: two routes (megarl/rollout/weights/): `collective`, vLLM's weight-transfer
  session (`init_weight_transfer` once per group, then per push `start_weight_update`, one
  `update_weights(update_info)` per bucket, received while the trainer broadcasts, and
  `finish_weight_update(version)`), and `files`, `reload_weights(path, version)`. Either way
  the engine then resets its prefix cache (KV of the old weights would be reused; vLLM cannot
  while held requests keep their KV: then cached prompt blocks of the old weights may serve
  new requests too, which is what rollout.keep_kv=true accepts), reports `version`
  (attribute and `health().version`) and stays paused until `resume()`.
- Routes (routing replay, `routes` set before start): `GenResult.routes` holds the experts each
  input token went to, one row per token of the request's prompt + `token_ids` but the last,
  from the weights that produced the token after it (a request held over an update keeps its
  earlier rows); `partial(key)` of a held request carries them once pause() returned. None
  where the engine could not capture them (a dense model).
- Errors are `EngineError`s naming the engine, its address and its log file; a request that
  fails carries what it had generated in `EngineError.partial`, which the pool continues
  elsewhere. An error the request caused (the engine refused it as invalid) is a
  `RequestError` instead: the engine stays in service and the request is not retried.
  In-process engines say so for vLLM's client errors (`VLLMClientError`: a prompt longer than
  max_model_len, token ids outside the vocabulary, sampling options out of range), HTTP engines
  for the server's 400 / 413 / 422 answers and error chunks of those codes. Its message names
  the engine by name only (no address or log path: callers may answer it to an outside agent).
  An engine that answered it failed the request (HTTP 5xx) raises a `ServerError` (an
  EngineError): the pool retries it there once when its health check answers.
"""
from __future__ import annotations

import abc
import asyncio
from dataclasses import dataclass, field
from typing import Optional

FINISH_REASONS = ("stop", "length", "abort")
# vLLM's answer to start_weight_update when a session is still open: a trainer died between
# start and finish (SIGKILL, pre-emption). Finishing it first restores the engine's own weights
# for whatever was not received (vLLM's layerwise finalize), then the new session starts.
STALE_SESSION = "weight update is already active"


class EngineError(RuntimeError):
    """An engine failed, died or did not answer in time. The message names the engine.
    `partial`: what the failed request had generated (a GenResult), when the engine knows;
    the pool continues the request elsewhere from it."""

    def __init__(self, message: str, partial: "GenResult | None" = None):
        super().__init__(message)
        self.partial = partial


class ServerError(EngineError):
    """The engine answered that it failed this request (a server's HTTP 5xx, or an error chunk
    of that code in its stream): unlike a lost connection or a silence, the server is up and
    said so. The pool asks its health and, when it answers, sends the request to it once more
    before it retires it (failover.py): one such answer must not cost the run a healthy engine."""


class RequestError(ValueError):
    """The request itself is wrong for this engine (a prompt longer than max_model_len, token
    ids outside the vocabulary, sampling options the engine refuses): the engine is healthy
    and answered so. Never a reason to retire an engine or to retry elsewhere: the caller
    answers it to whoever made the request (HTTP 400 to an agent, a failed sample scored 0 in
    a round, a named data error before a run). Deliberately not an EngineError."""

    def __init__(self, message: str, key: str = ""):
        super().__init__(message)
        self.key = key


@dataclass(frozen=True)
class GenRequest:
    """One sample to generate: prompt token ids in, at most `max_tokens` new tokens out."""
    key: str                           # unique among requests in flight on the pool
    prompt_ids: list[int]
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: Optional[int] = None         # per-request generator seed (reproducible sampling)
    ignore_eos: bool = False           # forced lengths (benchmarks)
    top_k: int = -1                    # the k likeliest tokens only (-1: off), applied before top_p

    def __post_init__(self):
        if self.max_tokens < 1:
            raise ValueError(f"GenRequest {self.key!r}: max_tokens={self.max_tokens} must be >= 1")
        if not self.prompt_ids:
            raise ValueError(f"GenRequest {self.key!r}: empty prompt")


@dataclass
class GenResult:
    """What one request produced. Lists are aligned: one entry per generated token."""
    key: str
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)   # behaviour logprob of each sampled token
    versions: list[int] = field(default_factory=list)     # weight version that produced each token
    finish_reason: str = "abort"                          # stop | length | abort
    engine: str = ""                                      # name of the engine that served it
    # routing replay (engine.routes set): the experts chosen for each input token of the
    # request's prompt + token_ids but the last, [rows, MoE layers, top-k] (routes.py); None
    # when not captured
    routes: object = None

    def extend(self, ids: list[int], logprobs: list[float], version: int) -> None:
        if len(ids) != len(logprobs):
            raise EngineError(f"engine {self.engine}: request {self.key} returned {len(ids)} "
                              f"tokens but {len(logprobs)} logprobs")
        self.token_ids += ids
        self.logprobs += logprobs
        self.versions += [version] * len(ids)

    @property
    def stopped(self) -> bool:
        """Stopped on EOS / a stop token (not on the token budget, not aborted)."""
        return self.finish_reason == "stop"


def copy_result(r: GenResult) -> GenResult:
    """A copy of what a request has so far (`Engine.partial`): later tokens do not change it."""
    return GenResult(r.key, list(r.token_ids), list(r.logprobs), list(r.versions), r.finish_reason, r.engine,
                     None if r.routes is None else r.routes.copy())


async def settle_streams(streamed, quiet_s: float = 0.03, limit_s: float = 2.0) -> None:
    """After a pause took hold: wait until `streamed()` (tokens received by the held requests)
    stops changing for `quiet_s`, at most `limit_s`. The engine stopped producing, but what
    it produced last may still be on its way to the client; `partial()` must include it."""
    loop = asyncio.get_running_loop()
    end = loop.time() + limit_s
    last, since = streamed(), loop.time()
    while loop.time() < end:
        await asyncio.sleep(quiet_s / 3)
        now = streamed()
        if now != last:
            last, since = now, loop.time()
        elif loop.time() - since >= quiet_s:
            return


@dataclass
class EngineHealth:
    name: str
    alive: bool
    paused: bool
    running: int                       # requests this client has in flight on the engine
    version: int                       # weight version the engine holds
    address: str = ""                  # URL, or "in-process"
    log: str = ""                      # log file of the engine process, when megarl started it


class Engine(abc.ABC):
    """An asyncio rollout engine. All methods run on the pool's event loop."""

    name: str
    version: int = 0
    routes: bool = False      # capture the experts each token was routed to (routing replay, r3)

    @abc.abstractmethod
    async def start(self) -> None:
        """Bring the engine up (or connect to it); raise EngineError if it cannot serve."""

    @abc.abstractmethod
    async def generate(self, req: GenRequest) -> GenResult:
        """Generate one sample; resolves with the partial result if aborted (module docstring:
        the contract)."""

    @abc.abstractmethod
    async def abort(self, keys: Optional[list[str]] = None) -> None:
        """Abort the given requests (None: all); returns once each has resolved."""

    @abc.abstractmethod
    async def pause(self) -> None:
        """Stop scheduling: running requests are held (not aborted) until resume()."""

    @abc.abstractmethod
    async def resume(self) -> None:
        ...

    def partial(self, key: str) -> Optional[GenResult]:
        """What the in-flight request `key` has streamed so far (a copy), None if not in flight."""
        raise NotImplementedError(f"engine {self.name} ({type(self).__name__}) cannot report a "
                                  f"running request's progress: set rollout.update_mode=abort")

    async def clear_kv(self) -> None:
        """Drop the held requests' KV and the prefix cache: they recompute it on resume."""
        raise EngineError(f"engine {self.name} ({type(self).__name__}) cannot drop held requests' KV: "
                          f"set rollout.keep_kv=true or rollout.update_mode=abort")

    @abc.abstractmethod
    async def reload_weights(self, path: str, version: int) -> None:
        """files transport: load the safetensors files in `path` (HF names) as `version`;
        reset the prefix cache."""

    # -- collective transport (vLLM's weight-transfer session); engines without it refuse --
    async def transfer_world_size(self) -> int:
        """Workers this engine puts in the weight group (its TP x PP x DP)."""
        raise self._no_collective()

    async def init_weight_transfer(self, init_info: dict) -> None:
        """Join the weight group described by `init_info` (returns once joined)."""
        raise self._no_collective()

    async def start_weight_update(self, staged: bool = False) -> None:
        """Open a session. `staged` (weight_sync.staged): the engine keeps generating while
        the buckets arrive into its staging area; it is paused only for the finish."""
        raise self._no_collective()

    async def update_weights(self, update_info: dict) -> None:
        """Receive one bucket (returns once its bytes arrived and are loaded)."""
        raise self._no_collective()

    async def finish_weight_update(self, version: int) -> None:
        """End the session: the received weights are now `version`; prefix cache reset."""
        raise self._no_collective()

    async def staged_ready(self) -> bool:
        """Whether a staged session's version is ready to swap in (engines/staged_swap.py),
        asked before the engines pause; True where nothing is prepared beside the model."""
        return True

    def _no_collective(self) -> "EngineError":
        return EngineError(f"engine {self.name} ({type(self).__name__}) has no weight-transfer "
                           f"session: set weight_sync.transport=files")

    @abc.abstractmethod
    async def health(self) -> EngineHealth:
        ...

    @property
    @abc.abstractmethod
    def running(self) -> int:
        """Requests in flight on this engine (the pool's load balance reads it)."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Release the engine (stop its processes if megarl started them). Idempotent."""
