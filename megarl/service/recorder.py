"""One agent episode's token record: chat messages in, the exact ids the engine saw out.

An outside agent speaks OpenAI chat messages; the trainer needs the token ids the engine
conditioned on and sampled. Re-rendering and re-tokenizing the whole conversation at each call
is not a bijection (the model's own tokens may come back as different ids) and costs O(T^2),
so the record only grows (docs/agents.md): the first call's messages are rendered with the chat
template (the assistant turn opened) as the prompt; each later call must send the recorded
conversation unchanged (earlier messages, then the assistant message exactly as returned) plus
new messages, and only those new messages are rendered, as a delta
(`megarl.envs.render.conversation_delta_ids`), appended as context: mask 0, logprob 0.0, the
version of the last model token. Completion tokens are kept as the engine returned them:
mask 1, their behaviour logprobs and versions.

Every call's prompt (the first call's rendered messages; later, the episode's tokens so far
and the new messages) must leave room for a completion token in the engines' context
(rollout.engines.max_model_len), and a completion is cut to the room left: an agent cannot send
what the engine would refuse, nor make an episode longer than the trainer's sequences.

Pure logic: no HTTP, no engine. Errors are `ServiceError`s carrying the HTTP status and the
OpenAI error type the app answers with.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megarl.data.sample import Sample, routes_needed
from megarl.envs.render import ObservationRenderer, conversation_delta_ids
from megarl.rollout import routes as route_rows

BUDGET_SPENT = "episode token budget spent"
# what an agent hears when the engines fail: never their URLs or log paths (the trainer's log has them)
ENGINE_FAILED = ("the policy's engines could not serve this call (an engine failure, reported in the trainer's "
                 "log); the episode is unchanged, the call may be sent again")


class ServiceError(Exception):
    """A request the service refuses: `status` (HTTP) and `type` (OpenAI's error type)."""

    TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
             409: "conflict_error", 429: "rate_limit_error", 503: "server_error"}

    def __init__(self, status: int, message: str, code: Optional[str] = None):
        super().__init__(message)
        self.status, self.message, self.code = status, message, code
        self.type = self.TYPES.get(status, "server_error")

    def body(self) -> dict:
        """OpenAI's error shape."""
        return {"error": {"message": self.message, "type": self.type, "code": self.code, "param": None}}


def normalize_message(message, index: int) -> dict:
    """A chat message as compared and rendered: fields set to None dropped (an agent passing
    back the client's message object sends `refusal: null` and the like), text parts of a list
    content joined into one string (OpenAI accepts both forms for text)."""
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise ServiceError(400, f"messages[{index}] must be an object with a string 'role'")
    out = {k: v for k, v in message.items() if v is not None}
    content = out.get("content")
    if isinstance(content, list):
        parts = [p.get("text") for p in content if isinstance(p, dict)]
        if len(parts) != len(content) or any(p.get("type") != "text" for p in content) or \
                not all(isinstance(t, str) for t in parts):
            raise ServiceError(400, f"messages[{index}].content: only text parts are supported")
        out["content"] = "".join(parts)
    elif content is not None and not isinstance(content, str):
        raise ServiceError(400, f"messages[{index}].content must be a string or a list of text parts")
    return out


def normalize_messages(messages) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise ServiceError(400, "'messages' must be a non-empty list of chat messages")
    return [normalize_message(m, i) for i, m in enumerate(messages)]


def _brief(message: dict) -> str:
    text = str(message.get("content", ""))
    return f"role={message.get('role')!r} content={text[:60]!r}{'...' if len(text) > 60 else ''}"


def extension_error(episode_id: str, recorded: list[dict], sent: list[dict]) -> Optional[str]:
    """Why `sent` does not extend the recorded conversation (None when it does): the first
    message that differs, or that nothing new was added."""
    for i, (old, new) in enumerate(zip(recorded, sent)):
        if old != new:
            what = "the assistant message as returned" if old.get("role") == "assistant" else "the recorded message"
            return (f"episode {episode_id}: messages[{i}] differs from {what} ({_brief(old)}; sent "
                    f"{_brief(new)}): a call must send the conversation so far unchanged, then new messages")
    if len(sent) <= len(recorded):
        return (f"episode {episode_id}: the call sends {len(sent)} messages, the conversation has "
                f"{len(recorded)}: send them all, the last assistant message as returned, then at least one "
                f"new message")
    return None


@dataclass
class Turn:
    """One call prepared against an episode, not yet recorded (`EpisodeRecorder.commit`)."""
    messages: list[dict]          # the conversation the call sent (normalized)
    prompt_ids: list[int]         # first call: the rendered prompt; later calls: the episode's
    history_ids: list[int]        # the episode's response ids so far (empty on the first call)
    context_ids: list[int]        # ids to append before the completion (empty on the first call)
    max_tokens: int               # what the engine may generate for this call

    @property
    def engine_prompt(self) -> list[int]:
        """Everything the engine conditions on (before the completion)."""
        return self.prompt_ids + self.history_ids + self.context_ids


class EpisodeRecorder:
    """The growing token record of one episode; `max_new_tokens` bounds its response ids
    (completions and context deltas together), `max_model_len` (the engines' context) its
    prompt and response ids together."""

    def __init__(self, episode_id: str, renderer: ObservationRenderer, max_new_tokens: int, max_model_len: int):
        if renderer.template != "chat":
            raise ValueError("an agent episode needs the tokenizer's chat template (the renderer's template is "
                             f"{renderer.template!r})")
        self.episode_id, self.renderer, self.max_new_tokens = episode_id, renderer, max_new_tokens
        self.max_model_len = max_model_len
        self.messages: list[dict] = []         # conversation so far, ending with the assistant message returned
        self.prompt_ids: list[int] = []
        self.response_ids: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[int] = []
        self.mask: list[int] = []
        # routing replay: the experts each token of prompt + response but the last went to,
        # [rows, MoE layers, top-k] (rollout/routes.py); None when the engines capture none
        self.routes = None
        self.calls = 0
        self.finish_reason = ""
        self.observation_tokens = 0

    @property
    def budget_left(self) -> int:
        return self.max_new_tokens - len(self.response_ids)

    def _render_prompt(self, messages: list[dict]) -> list[int]:
        tok = self.renderer.tokenizer
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        # the template writes its own special tokens (BOS): the tokenizer must not add them again
        return tok(text, add_special_tokens=False)["input_ids"]

    def _delta(self, messages: list[dict]) -> list[int]:
        error = extension_error(self.episode_id, self.messages, messages)
        if error:
            raise ServiceError(409, error, "history_rewritten")
        last = self.response_ids[-1] if self.response_ids else None
        try:
            return conversation_delta_ids(self.renderer, self.messages, messages, last)
        except ValueError as err:
            raise ServiceError(409, f"episode {self.episode_id}: {err}", "history_rewritten") from err

    def prepare(self, messages, max_tokens: Optional[int] = None) -> Turn:
        """The call sending `messages` -> what the engine is asked (nothing recorded yet: a call
        that fails leaves the episode as it was, and may be sent again)."""
        messages = normalize_messages(messages)
        if self.calls == 0:
            prompt, context = self._render_prompt(messages), []
        else:
            prompt, context = self.prompt_ids, self._delta(messages)
        left = self.budget_left - len(context)
        if left < 1:
            raise ServiceError(400, f"episode {self.episode_id}: {BUDGET_SPENT} ({self.max_new_tokens} response "
                                    f"tokens, rollout.sampling.max_new_tokens; {len(self.response_ids)} used, "
                                    f"{len(context)} more for the new messages): end it with a reward", "budget_spent")
        if max_tokens is not None and max_tokens < 1:
            raise ServiceError(400, f"max_tokens={max_tokens} must be >= 1")
        left = min(left, self._room(len(prompt) + len(self.response_ids) + len(context)))
        return Turn(messages, list(prompt), list(self.response_ids), context,
                    left if max_tokens is None else min(max_tokens, left))

    def _room(self, prompt_len: int) -> int:
        """Completion tokens the engines' context leaves after a prompt of `prompt_len` tokens;
        ServiceError (400) when not even one."""
        room = self.max_model_len - prompt_len
        if room >= 1:
            return room
        if self.calls == 0:
            why = (f"the first call's messages render to {prompt_len} tokens, and the policy's context holds "
                   f"rollout.engines.max_model_len={self.max_model_len} tokens, prompt and completion together: "
                   f"send shorter messages")
        else:
            why = (f"with the new messages the episode holds {prompt_len} tokens, and the policy's context holds "
                   f"rollout.engines.max_model_len={self.max_model_len} tokens, prompt and completion together: "
                   f"end it with a reward")
        raise ServiceError(400, f"episode {self.episode_id}: {why}", "context_full")

    def commit(self, turn: Turn, token_ids: list[int], logprobs: list[float], versions: list[int],
               finish_reason: str, content: str, routes=None) -> None:
        """Record a call's context delta and the engine's completion; `content` (the decoded
        completion) becomes the assistant message the next call must send back. `routes`: the
        call's rows over its whole engine prompt and completion; the episode keeps the rows it
        had (each token's from the call that first fed it, as megarl's own episodes do:
        rollout/slots.set_tokens) and adds the call's past them (the last token of the previous
        completion, the context delta and the completion)."""
        if not len(token_ids) == len(logprobs) == len(versions):
            raise ValueError(f"episode {self.episode_id}: {len(token_ids)} tokens, {len(logprobs)} logprobs, "
                             f"{len(versions)} versions")
        if self.calls == 0:
            self.prompt_ids = list(turn.prompt_ids)
        self.routes = route_rows.join(self.routes, routes, len(self.prompt_ids) + len(self.response_ids) - 1
                                      if self.calls else 0)
        if turn.context_ids:
            # context is stamped with the last model token's version (a first turn that produced
            # nothing has none: then the version of this call's first token)
            version = self.versions[-1] if self.versions else (versions[0] if versions else 0)
            self.response_ids += turn.context_ids
            self.logprobs += [0.0] * len(turn.context_ids)
            self.versions += [version] * len(turn.context_ids)
            self.mask += [0] * len(turn.context_ids)
            self.observation_tokens += len(turn.context_ids)
        self.response_ids += token_ids
        self.logprobs += logprobs
        self.versions += versions
        self.mask += [1] * len(token_ids)
        self.messages = turn.messages + [{"role": "assistant", "content": content}]
        self.calls += 1
        self.finish_reason = finish_reason

    def trajectory(self) -> dict:
        return {"prompt_ids": list(self.prompt_ids), "response_ids": list(self.response_ids),
                "mask": list(self.mask), "logprobs": list(self.logprobs), "versions": list(self.versions),
                "turns": self.calls, "finish_reason": self.finish_reason}

    def to_sample(self, reward: float, group: int, record: dict, uid: int) -> Sample:
        """The episode as one training sample (turns = model calls; stopped: the last call
        ended on EOS)."""
        return Sample(prompt_ids=list(self.prompt_ids), response_ids=list(self.response_ids),
                      logprobs=list(self.logprobs), versions=list(self.versions),
                      stopped=self.finish_reason == "stop", group=group, record=record, reward=float(reward),
                      finish_reason=self.finish_reason, uid=uid, mask=list(self.mask), turns=self.calls,
                      routes=route_rows.usable(self.routes, route_rows.expected_rows(len(self.prompt_ids),
                                                                                     len(self.response_ids)),
                                               routes_needed(len(self.prompt_ids), self.mask)))
