#!/usr/bin/env python
"""An outside agent for `rollout.mode=service`: plays "guess the number" episodes against the
policy megarl serves, with the `openai` client, and reports each episode's reward.

    python examples/guess_agent.py --service runs/tiny_agent_service/service.json [--episodes N]

megarl writes the endpoint's URL, model name and API key to <run.dir>/service.json when the
run starts (owner-only). Each episode: `POST /v1/episodes` hands out a task (a record of the
run's data, here a secret number and the opening user message); the agent sends the
conversation to `/v1/chat/completions` (the episode named in `extra_body`), judges the model's
guess itself (the environment lives here, not in megarl), appends its answer as a user message
and asks again, up to --max-turns; `POST /v1/episodes/{id}/reward` ends it. megarl trains on
the token ids it recorded for every call, so the agent must send back the assistant messages
exactly as it got them, and only add messages after them.
"""
from __future__ import annotations

import argparse
import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai


def connect(service_json: str, wait_s: float = 600.0) -> dict:
    """The service's coordinates, once megarl has written them (it starts engines first)."""
    deadline = time.time() + wait_s
    while True:
        try:
            with open(service_json) as f:
                return json.load(f)
        except (FileNotFoundError, json.JSONDecodeError):
            if time.time() > deadline:
                raise TimeoutError(f"{service_json} did not appear within {wait_s:g} s: is megarl running "
                                   f"with rollout.mode=service?") from None
            time.sleep(0.5)


def judge(answer: str, secret: int, k: int) -> tuple[str, float, bool]:
    """The environment: (observation, reward, done) for the model's answer."""
    words = answer.split()
    guess = int(words[0][1:]) if len(words) == 1 and words[0][:1] == "n" and words[0][1:].isdigit() else None
    if guess is None or not 1 <= guess <= k:
        return "invalid", 0.0, False
    if guess == secret:
        return "correct", 1.0, True
    return ("higher" if secret > guess else "lower"), 0.0, False


def play(client: openai.OpenAI, http: httpx.Client, model: str, max_turns: int) -> dict:
    """One episode; returns what happened (reward, turns, the calls' logprobs)."""
    episode = http.post("/v1/episodes").raise_for_status().json()
    eid, task = episode["episode_id"], episode["task"]
    messages = list(task["messages"])
    reward, calls = 0.0, []
    for _ in range(max_turns):
        try:
            reply = client.chat.completions.create(model=model, messages=messages, logprobs=True,
                                                   extra_body={"episode_id": eid})
        except openai.BadRequestError as err:   # e.g. the episode's token budget is spent
            calls.append({"error": str(err)})
            break
        choice = reply.choices[0]
        calls.append({"content": choice.message.content,
                      "logprobs": [t.logprob for t in (choice.logprobs.content if choice.logprobs else [])]})
        messages.append({"role": "assistant", "content": choice.message.content})
        observation, reward, done = judge(choice.message.content, task["secret"], task.get("k", 8))
        if done:
            break
        messages.append({"role": "user", "content": observation})
    http.post(f"/v1/episodes/{eid}/reward", json={"reward": reward}).raise_for_status()
    return {"episode_id": eid, "reward": reward, "turns": len(calls), "calls": calls}


def run(service: dict, episodes: int, workers: int = 8, max_turns: int = 4) -> list[dict]:
    """Play `episodes` episodes, `workers` at a time (the service limits open episodes)."""
    headers = {"Authorization": f"Bearer {service['api_key']}"}
    client = openai.OpenAI(base_url=service["base_url"], api_key=service["api_key"], max_retries=0, timeout=600)
    with httpx.Client(base_url=service["url"], headers=headers, timeout=600) as http, \
            ThreadPoolExecutor(workers) as pool:
        return list(pool.map(lambda _: play(client, http, service["model"], max_turns), range(episodes)))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--service", required=True, help="<run.dir>/service.json of the megarl run")
    ap.add_argument("--episodes", type=int, default=64)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--max-turns", type=int, default=4)
    args = ap.parse_args(argv)
    done = run(connect(args.service), args.episodes, args.workers, args.max_turns)
    print(json.dumps({"episodes": len(done), "reward_mean": sum(d["reward"] for d in done) / max(1, len(done))}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
