"""HTTPVLLMEngine / LocalServerEngine against real vLLM OpenAI servers on the tiny model.

One server serves the whole module (startup is 30-80 s on CPU); the server-death test starts
its own. The server runs a copy of the tiny model whose config allows 4096 positions (RoPE has
no learned position table, so the weights are the same): the abort and pause tests need
requests that cannot finish before the abort reaches them, and at 256 positions a fast idle
machine generated a whole 220-token budget first. Logprobs are checked against a transformers
forward of the same weights, with the logits divided by the sampling temperature (the server
runs --logprobs-mode processed_logprobs).
"""
import asyncio
import json
import os
import random
import secrets
import shutil
import signal
import stat
import time

import engine_contract
import psutil
import pytest
from engine_contract import hf_logprobs, hf_model

from megarl.rollout.engines import held_tokens, reaper
from megarl.rollout.engines.engine import EngineError, GenRequest
from megarl.rollout.engines.servers import LocalServer, LocalServerEngine
from megarl.rollout.engines.vllm_http import HTTPVLLMEngine
from tools.model_positions import with_positions

MAX_LEN = 4096
LONG = 4000          # a budget no request finishes while a test waits to abort or pause it
START_TIMEOUT_S = 300


def prompt(seed: int, length: int = 16) -> list[int]:
    rng = random.Random(seed)
    return [1] + [rng.randrange(4, 128) for _ in range(length - 1)]


async def wait_until(cond, timeout_s=120.0, what="condition"):
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.005)


@pytest.fixture(scope="module")
def long_model(tiny_model, tmp_path_factory):
    """The tiny model with max_position_embeddings = MAX_LEN (same weights)."""
    return with_positions(tiny_model, tmp_path_factory.mktemp("long") / "long_model", MAX_LEN)


@pytest.fixture(scope="module")
def server(long_model, tmp_path_factory):
    """One vLLM server for the module (the engines under test connect to it)."""
    log = tmp_path_factory.mktemp("engines") / "engine_0.log"
    srv = LocalServer(long_model, log, api_key=secrets.token_hex(8), seed=0, max_model_len=MAX_LEN,
                      kv_cache_mb=64, weight_backend="gloo")

    srv.start()
    try:
        srv.wait_healthy(START_TIMEOUT_S)
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def hf(long_model):
    return hf_model(long_model)


@pytest.fixture(scope="module")
def changed(long_model, tmp_path_factory):
    """Other weights for the held-request checks, and their transformers reference."""
    path = engine_contract.changed_weights(long_model, tmp_path_factory.mktemp("changed_weights"))
    model = hf_model(path)
    return path, lambda p, toks, t: hf_logprobs(model, p, toks, t)


def run_with_engine(server, body, timeout_s=60.0):
    """Run `body(engine)` with a fresh client of the module's server."""
    async def main():
        engine = HTTPVLLMEngine("e0", server.url, server.api_key, timeout_s, server.log_path)
        await engine.start()
        try:
            return await body(engine)
        finally:
            await engine.close()
    return asyncio.run(main())


def test_sampled_logprobs_match_transformers_at_temperature(server, hf):
    async def body(engine):
        assert engine.model == "megarl-policy"
        reqs = [GenRequest(f"s{i}", prompt(i), 24, temperature=0.7, seed=i, ignore_eos=True) for i in range(4)]
        return await asyncio.gather(*(engine.generate(r) for r in reqs)), reqs

    results, reqs = run_with_engine(server, body)
    for req, res in zip(reqs, results):
        assert res.finish_reason == "length" and len(res.token_ids) == 24
        assert len(res.logprobs) == len(res.versions) == 24 and set(res.versions) == {0}
        ref = hf_logprobs(hf, req.prompt_ids, res.token_ids, 0.7)
        assert max(abs(a - b) for a, b in zip(ref, res.logprobs)) < 1e-4


async def far_from_budget(engine, keys, tasks):
    """The precondition of an abort test, from the server itself: pause, read its count of
    each request's tokens (/megarl/held_tokens), resume. Each is still running and at least
    LONG - count - 1 tokens away from its budget, thousands of decode steps, while the abort
    that follows takes one round trip: the check cannot be outrun however fast the engine."""
    await engine.pause()
    try:
        held = await engine.held_counts()
        counts = {k: held.get(k) for k in keys}
    finally:
        await engine.resume()
    assert not any(t.done() for t in tasks) and all(n is not None and n < LONG // 2 for n in counts.values()), counts
    return counts


def test_abort_keeps_partial_and_greedy_continuation_matches(server):
    """An aborted greedy request keeps the tokens it streamed, and continuing from them gives
    the tokens an uninterrupted request gives. The aborted request has a budget it cannot reach
    before the abort (LONG); the reference is generated afterwards at the length needed."""
    p, more = prompt(100), 32

    async def body(engine):
        task = asyncio.create_task(engine.generate(GenRequest("cut", p, LONG, temperature=0.0, ignore_eos=True)))
        await wait_until(lambda: engine.progress("cut") >= 8 or task.done(), what="first tokens")
        await far_from_budget(engine, ["cut"], [task])
        t0 = time.monotonic()
        await engine.abort(["cut"])
        abort_s = time.monotonic() - t0
        assert task.done(), "abort() returned before the aborted generate() resolved"
        part = task.result()
        k = len(part.token_ids)
        assert part.finish_reason == "abort" and 0 < k < LONG, (part.finish_reason, k)
        cont = await engine.generate(GenRequest("cont", p + part.token_ids, more, temperature=0.0,
                                                ignore_eos=True))
        full = await engine.generate(GenRequest("full", p, k + more, temperature=0.0, ignore_eos=True))
        return full, part, cont, abort_s, engine.running

    full, part, cont, abort_s, running = run_with_engine(server, body)
    assert full.finish_reason == "length" and len(full.token_ids) == len(part.token_ids) + more
    assert len(part.logprobs) == len(part.token_ids) == len(part.versions)
    assert abort_s < 2.0
    assert running == 0
    assert part.token_ids == full.token_ids[:len(part.token_ids)]
    assert part.token_ids + cont.token_ids == full.token_ids


def test_abort_all_resolves_every_running_request(server):
    async def body(engine):
        reqs = [GenRequest(f"a{i}", prompt(200 + i), LONG, temperature=1.0, seed=i, ignore_eos=True)
                for i in range(4)]
        tasks = [asyncio.create_task(engine.generate(r)) for r in reqs]
        await wait_until(lambda: all(engine.progress(r.key) > 0 for r in reqs) or any(t.done() for t in tasks),
                         what="all requests streaming")
        await far_from_budget(engine, [r.key for r in reqs], tasks)
        await engine.abort()
        assert all(t.done() for t in tasks)
        return [t.result() for t in tasks], engine.running

    results, running = run_with_engine(server, body)
    assert running == 0
    for r in results:
        assert r.finish_reason == "abort" and 0 < len(r.token_ids) < LONG
        assert len(r.logprobs) == len(r.token_ids)


def test_weight_update_needs_pause_and_stamps_new_version(server, long_model, hf, tmp_path):
    from safetensors.torch import load_file, save_file
    new_dir = tmp_path / "w09"
    new_dir.mkdir()
    sd = load_file(str(long_model / "model.safetensors"))
    save_file({k: (v * 0.9).contiguous() for k, v in sd.items()}, str(new_dir / "model.safetensors"))
    shutil.copy(long_model / "config.json", new_dir)
    hf_new = hf_model(new_dir)
    p = prompt(300)

    async def body(engine):
        with pytest.raises(EngineError, match="paused"):
            await engine.reload_weights(str(new_dir), 3)
        # a request held by the pause lives through the update (rollout.update_mode=keep)
        held = asyncio.create_task(engine.generate(GenRequest("held", p, LONG, temperature=1.0, ignore_eos=True)))
        try:
            await wait_until(lambda: engine.progress("held") > 0 or held.done(), what="held request streaming")
            await engine.pause()
            assert (await engine.health()).paused
            k = engine.progress("held")
            await engine.reload_weights(str(new_dir), 3)
            assert not held.done(), "the update ended the held request"
            await engine.resume()
            await wait_until(lambda: engine.progress("held") > k + 4 or held.done(), what="held request going on")
            health = await engine.health()
            await engine.abort(["held"])
            part = held.result()
            res = await engine.generate(GenRequest("new", p, 24, temperature=0.7, seed=1, ignore_eos=True))
        finally:   # the module's other tests expect the original weights and nothing running
            await engine.abort()
            await engine.pause()
            await engine.reload_weights(str(long_model), 0)
            await engine.resume()
        assert part.finish_reason == "abort" and part.versions == [0] * k + [3] * (len(part.token_ids) - k)
        return health, res

    health, res = run_with_engine(server, body)
    assert health.alive and not health.paused and health.version == 3 and health.running == 1
    assert res.versions == [3] * 24
    ref = hf_logprobs(hf_new, p, res.token_ids, 0.7)
    assert max(abs(a - b) for a, b in zip(ref, res.logprobs)) < 1e-4
    old = hf_logprobs(hf, p, res.token_ids, 0.7)
    assert max(abs(a - b) for a, b in zip(old, res.logprobs)) > 1e-2   # the update really changed them


# every route a client could use to steer the engine or its weights; bodies are harmless
CONTROL_ROUTES = [
    ("POST", "/pause?mode=keep", None), ("POST", "/resume", None), ("GET", "/is_paused", None),
    ("POST", "/abort_requests", {"request_ids": ["nobody"]}),
    ("POST", "/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": "/nowhere"}}),
    ("POST", "/reset_prefix_cache", None), ("POST", "/update_weight_version", {"new_version": "7"}),
    ("GET", "/weight_info", None), ("GET", "/get_world_size", None),
    ("POST", "/init_weight_transfer_engine", {"init_info": {}}), ("POST", "/start_weight_update", None),
    ("POST", "/update_weights", {"update_info": {}}), ("POST", "/finish_weight_update", None),
    ("POST", "/shutdown_weight_transfer_engine", None), ("GET", "/metrics", None),
    ("GET", "/v1/models", None), ("POST", "/v1/completions", {"prompt": [1, 2], "max_tokens": 1}),
    ("GET", held_tokens.ROUTE, None),
]
# the ones safe to serve with the key (they leave the engine as it was)
SAFE_WITH_KEY = {"/is_paused", "/weight_info", "/get_world_size", "/reset_prefix_cache", "/v1/models", "/resume"}


def _http(url, method, path, body, key=None):
    import urllib.error
    import urllib.request
    req = urllib.request.Request(url + path, method=method, data=None if body is None else json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json",
                                          **({"Authorization": f"Bearer {key}"} if key else {})})
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(req, timeout=30) as r:
            return r.status
    except urllib.error.HTTPError as err:
        return err.code


def test_every_control_and_weight_route_needs_the_key(server):
    """Contract: on a megarl-started server every control and weight-transfer route (vLLM
    guards only /v1 and a few prefixes) answers 401 without the key or with a wrong one, and
    serves the request with it; /health stays open for readiness polls."""
    refused = {path: (_http(server.url, m, path, body), _http(server.url, m, path, body, key="wrong"))
               for m, path, body in CONTROL_ROUTES}
    assert all(codes == (401, 401) for codes in refused.values()), refused
    served = {path: _http(server.url, m, path, body, key=server.api_key)
              for m, path, body in CONTROL_ROUTES if path in SAFE_WITH_KEY}
    assert all(code == 200 for code in served.values()), served
    assert _http(server.url, "GET", "/health", None) == 200
    # counts of a running engine would be out of date as they are read
    assert _http(server.url, "GET", held_tokens.ROUTE, None, key=server.api_key) == 409


class LaggingClient(HTTPVLLMEngine):
    """A client that takes what it read into account LAG_S late, as a client on a loaded
    machine does: the engine is up to 2 x LAG_S ahead of what the client holds."""
    LAG_S = 0.3

    async def _wait_alive(self, req, f, coro, what):
        data = await super()._wait_alive(req, f, coro, what)
        await asyncio.sleep(self.LAG_S)
        return data


def test_pause_returns_once_the_client_holds_every_token_the_engine_generated(server):
    """The pause contract, whatever the delivery's speed: once pause() returned, the client
    holds exactly the tokens the engine generated for each held request before the pause (the
    server's own count, /megarl/held_tokens), and none arrives while paused. A client whose
    reads lag behind the stream fails this when pause() only waits for a quiet stream."""
    async def main():
        engine = LaggingClient("lag", server.url, server.api_key, 120.0, server.log_path)
        await engine.start()
        keys = [f"lag{i}" for i in range(3)]
        tasks = [asyncio.create_task(engine.generate(GenRequest(k, prompt(600 + i), LONG, temperature=1.0,
                                                                  seed=i, ignore_eos=True)))
                 for i, k in enumerate(keys)]
        try:
            await wait_until(lambda: all(engine.progress(k) > 0 for k in keys) or any(t.done() for t in tasks),
                             what="requests streaming")
            await engine.pause()
            held = {k: engine.progress(k) for k in keys}
            by_server = await engine.held_counts()
            counts = {k: by_server.get(k) for k in keys}
            await asyncio.sleep(0.5)
            later = {k: engine.progress(k) for k in keys}
            await engine.resume()
            await engine.abort()
            return held, counts, later, [t.result() for t in tasks]
        finally:
            await engine.abort()
            await engine.close()

    held, counts, later, results = asyncio.run(main())
    # the precondition (a request still below its budget at the pause) comes from the server
    assert all(n is not None and 0 < n < LONG for n in counts.values()), counts
    assert held == counts, f"pause() returned before the client held every token: {held} vs the server's {counts}"
    assert later == held, "tokens arrived while paused"
    assert all(r.finish_reason == "abort" and len(r.token_ids) >= held[r.key] for r in results)


def test_a_weight_session_left_open_by_a_dead_trainer_is_closed_by_the_next(server, hf):
    """Contract: a trainer killed between start_weight_update and finish leaves the server's
    session open (vLLM then refuses a new start); the next trainer's start closes it (the
    engine keeps its own weights for what was not received) and opens its own, and the
    engine still samples as the unchanged model does."""
    p = prompt(400)

    async def body(engine):
        await engine.pause()
        try:
            status = _http(server.url, "POST", "/start_weight_update", None, key=server.api_key)
            assert status == 200                       # the dead trainer's session
            assert _http(server.url, "POST", "/start_weight_update", None, key=server.api_key) != 200
            await engine.start_weight_update()         # closes it and opens ours
            await engine.finish_weight_update(0)       # nothing received: the weights stay
        finally:
            await engine.resume()
        return await engine.generate(GenRequest("after", p, 16, temperature=0.7, seed=3, ignore_eos=True))

    res = run_with_engine(server, body)
    ref = hf_logprobs(hf, p, res.token_ids, 0.7)
    assert len(res.token_ids) == 16 and max(abs(a - b) for a, b in zip(ref, res.logprobs)) < 1e-4


@pytest.mark.parametrize("check", engine_contract.CHECKS, ids=lambda c: c.__name__)
def test_http_engine_keeps_the_engine_contract(server, hf, long_model, changed, check):
    """tests/engine_contract.py on an HTTP engine of the module's megarl-started server; the
    logprobs' reference is a transformers forward of the same weights."""
    def body(engine):
        return check(engine_contract.Subject(
            engine, prompt=lambda i: prompt(500 + i), weights=str(long_model), long=LONG,
            reference=lambda p, toks, t: hf_logprobs(hf, p, toks, t), progress=engine.progress,
            settle_s=0.3, timeout_s=120, changed=changed, span=1000))
    run_with_engine(server, body)


def test_startup_failure_names_log_and_fails_fast(tiny_model, tmp_path):
    log = tmp_path / "engine_bad.log"
    srv = LocalServer(tiny_model, log, api_key="k", extra_args=("--logprobs-mode", "bogus"))
    engine = LocalServerEngine("bad", srv, timeout_s=20, start_timeout_s=START_TIMEOUT_S)
    t0 = time.monotonic()
    with pytest.raises(EngineError) as info:
        asyncio.run(engine.start())
    msg = str(info.value)
    assert str(log) in msg and srv.url in msg and "engine bad" in msg
    assert "invalid choice" in msg                     # the log's last lines say why
    assert time.monotonic() - t0 < 120
    assert not srv.process_alive()


def _group_members(pgid):
    out = []
    for p in psutil.process_iter(["pid", "status"]):
        try:
            if os.getpgid(p.pid) == pgid and p.info["status"] != psutil.STATUS_ZOMBIE:
                out.append(p.pid)
        except (ProcessLookupError, psutil.Error):
            pass
    return out


def _live_children() -> set:
    return {c.pid for c in psutil.Process().children(recursive=True) if c.status() != psutil.STATUS_ZOMBIE}


def test_engine_sockets_live_in_a_private_folder(server):
    """vLLM's ZMQ sockets (API server <-> engine core <-> worker) are files in
    $VLLM_RPC_BASE_PATH, which vLLM never removes: a server megarl starts puts them in the
    owner-only folder of the process that started it (megarl.rollout.engines.reaper.private_rpc_dir),
    removed with that process, not loose in /tmp."""
    folder = reaper.private_rpc_dir()
    assert folder and os.path.basename(folder).startswith(reaper.RPC_PREFIX)
    root = psutil.Process(server.proc.pid)
    paths = {c.laddr for p in [root, *root.children(recursive=True)]
             for c in p.net_connections(kind="unix") if c.laddr}
    ipc = {x for x in paths if os.path.basename(x).count("-") == 4}      # <uuid4> names
    assert ipc and all(os.path.dirname(x) == folder for x in ipc), (folder, paths)
    assert all(stat.S_ISSOCK(os.stat(x).st_mode) for x in ipc)


def test_server_death_mid_request_raises_with_log_path(server):
    """The module's last test: it kills the module's server (a LocalServerEngine over a server
    already running starts no other; starting one costs ~1 min of CPU)."""
    srv, log = server, server.log_path
    tree = set()
    engine = LocalServerEngine("doomed", srv, timeout_s=20, start_timeout_s=START_TIMEOUT_S)

    async def body():
        await engine.start()
        try:
            reqs = [GenRequest(f"d{i}", prompt(400 + i), LONG, temperature=1.0, seed=i, ignore_eos=True)
                    for i in range(4)]
            tasks = [asyncio.create_task(engine.generate(r)) for r in reqs]
            await wait_until(lambda: engine.progress("d0") > 0, what="streaming")
            root = psutil.Process(srv.proc.pid)
            tree.update([root.pid, *(c.pid for c in root.children(recursive=True))])
            os.killpg(srv.proc.pid, signal.SIGKILL)
            t0 = time.monotonic()
            results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 60)
            return results, time.monotonic() - t0
        finally:
            await engine.close()

    pgid = None
    try:
        results, elapsed = asyncio.run(body())
        pgid = srv.proc.pid
    finally:
        srv.stop()
    errors = [r for r in results if isinstance(r, EngineError)]
    assert errors, f"no request failed: {results}"
    assert all(isinstance(r, EngineError) or r.finish_reason == "length" for r in results)
    assert all(str(log) in str(e) and "doomed" in str(e) for e in errors)
    # the tokens streamed before the death travel with the error (the pool continues from them)
    d0 = results[0]
    assert isinstance(d0, EngineError) and d0.partial.token_ids and \
        len(d0.partial.token_ids) == len(d0.partial.logprobs) == len(d0.partial.versions)
    assert any("exited" in str(e) for e in errors)     # exit code and log tail are in the message
    assert elapsed < 20
    assert not srv.process_alive()
    assert _group_members(pgid) == [], "vLLM processes survived the kill"
    assert len(tree) >= 3 and not tree & _live_children(), "a process of the killed server is still our child"
