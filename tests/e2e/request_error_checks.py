"""Requests a real vLLM engine refuses as invalid, sent through each caller; shared by the HTTP
engine test (tests/e2e/test_request_errors.py, in its process) and the in-process engine's probe
(request_error_probe.py, a fresh process, as vLLM's AsyncLLM changes process-wide state).

`observe(sp, tokenizer, max_model_len)` runs every case on a started SyncPool of one engine
whose context is `max_model_len` and returns what happened, as plain data the test asserts on:
- each kind of refusal (a prompt longer than max_model_len, a token id outside the vocabulary,
  top_p and temperature out of range) straight on the pool: the error's class and message,
  and a normal request after each;
- sync rollout of a group that fits and one that does not;
- the weight-sync verify probe over those two prompts;
- the agent service (its own context set larger than the engine's, so the engine refuses): an
  agent's call too long for the engine, then a short one.
"""
from __future__ import annotations

import asyncio

from megarl.rollout.controller.sync_rollout import generate_groups
from megarl.rollout.engines.engine import GenRequest, RequestError
from megarl.rollout.weights.sync import probe_engines

GOOD = [1, 5, 9, 12, 17, 20, 23]
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'assistant' %} {{ m['content'] }} "
                 "{{ eos_token }}{% else %} {{ m['content'] }}{% endif %}{% endfor %}")


def cases(max_model_len: int, vocab: int) -> dict[str, GenRequest]:
    return {"too_long": GenRequest("too_long", [1] + [5] * (max_model_len + 40), 8),
            "bad_token_id": GenRequest("bad_token_id", [1, vocab + 1000, 5], 8),
            "negative_token_id": GenRequest("negative_token_id", [1, -3, 5], 8),
            "bad_top_p": GenRequest("bad_top_p", GOOD, 8, top_p=0.0),
            "bad_temperature": GenRequest("bad_temperature", GOOD, 8, temperature=-1.0)}


def _outcome(sp, req: GenRequest) -> dict:
    try:
        r = sp.call(sp.pool.generate(req), f"request {req.key}")
        return {"error": None, "tokens": len(r.token_ids), "finish_reason": r.finish_reason}
    except Exception as err:  # noqa: BLE001 - the test asserts on the class and the message
        return {"error": type(err).__name__, "request_error": isinstance(err, RequestError),
                "message": str(err), "key": getattr(err, "key", None)}


def observe(sp, tokenizer, max_model_len: int, vocab: int) -> dict:
    out: dict = {"cases": {}}
    for name, req in cases(max_model_len, vocab).items():
        out["cases"][name] = _outcome(sp, req)
        out["cases"][name]["then"] = _outcome(sp, GenRequest(f"after_{name}", GOOD, 8))
    too_long = cases(max_model_len, vocab)["too_long"].prompt_ids

    async def rollout():
        return await generate_groups(sp.pool, [{"g": 0}, {"g": 1}], [GOOD, too_long], 2, 8)
    samples = sp.call(rollout(), "sync rollout")
    out["rollout"] = [{"group": s.group, "finish_reason": s.finish_reason, "tokens": len(s.response_ids)}
                      for s in samples]
    probes = probe_engines(sp, [GOOD, too_long], 4, 1.0)
    out["probe"] = {name: [len(s.prompt_ids) for s in samples] for name, samples in probes.items()}
    out["service"] = _service(sp, tokenizer, max_model_len)
    out["failures"] = list(sp.pool.failures)
    out["engines_alive"] = [h.alive for h in sp.health()]
    return out


def _service(sp, tokenizer, max_model_len: int) -> dict:
    """An agent's calls over HTTP: one too long for the engine (the service's own bound set
    above it), then a short one in a new episode."""
    import httpx

    from megarl.service import AgentService
    tokenizer.chat_template = CHAT_TEMPLATE
    service = AgentService(sp.pool, tokenizer, next_task=lambda: ({"prompt": "task"}, 0), n=2, api_key="key-123",
                           max_new_tokens=8, max_model_len=4 * max_model_len, temperature=1.0)
    sp.call(service.start(), "starting the agent service")
    try:
        http = httpx.Client(base_url=service.url + "/v1", trust_env=False, timeout=120,
                            headers={"Authorization": "Bearer key-123"})
        answers = {}
        for name, words in (("too_long", max_model_len + 40), ("short", 4)):
            eid = http.post("/episodes").json()["episode_id"]
            resp = http.post("/chat/completions", json={
                "model": "m", "episode_id": eid, "messages": [{"role": "user", "content": " ".join(["n5"] * words)}]})
            answers[name] = {"status": resp.status_code, "body": resp.text}
        return answers
    finally:
        sp.call(service.close(), "stopping the agent service")
        sp.call(asyncio.sleep(0), "settling")
