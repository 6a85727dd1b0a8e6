"""Environment text -> token ids appended to an episode, never re-tokenizing what the model said.

The trainer must see exactly the ids the engine conditioned on. So an episode's ids only grow:
model tokens are kept as the engine sampled them, and each observation is rendered alone as a
*delta* and appended. Two ways (`env.template`):
- `chat`: the tokenizer's chat template. The delta is what the template adds after an
  assistant turn for one more user (`role`) message, with the next assistant turn opened:
  render([user, assistant]) vs render([user, assistant, observation], add_generation_prompt).
  The template's text after the assistant's end-of-turn token (Qwen's "\n" after <|im_end|>)
  is put back in front, since the engine stopped at that token and never produced it (the
  boundary bug trackers report); and the end-of-turn token itself when the turn did not end
  on it.
- `text`: the observation encoded as is (no special tokens): the environment formats it.
"""
from __future__ import annotations

from typing import Optional

_PROBE_USER, _PROBE_ASSISTANT = "PROBE_USER_TEXT", "PROBE_ASSISTANT_TEXT"


class ObservationRenderer:
    """`ids(text, last_token)` -> the token ids of one observation, to append after a model
    turn whose last token is `last_token`."""

    def __init__(self, tokenizer, template: str = "auto", role: str = "user"):
        has_template = bool(getattr(tokenizer, "chat_template", None))
        if template == "auto":
            template = "chat" if has_template else "text"
        if template not in ("chat", "text"):
            raise ValueError(f"env.template={template!r}: use auto, chat or text")
        if template == "chat" and not has_template:
            raise ValueError("env.template=chat: the model's tokenizer has no chat template; "
                             "set env.template=text (the environment then formats its observations)")
        self.tokenizer, self.template, self.role = tokenizer, template, role
        self.end_id: Optional[int] = None
        if template == "chat":
            self._tail, self._end_text = self._turn_end()
            self.end_id = self._single_id(self._end_text) if self._end_text else None

    def _render(self, messages, gen: bool = False) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)

    def text_ids(self, text: str) -> list[int]:
        """`text` encoded as is (no special tokens added, no template)."""
        return self.tokenizer(text, add_special_tokens=False)["input_ids"] if text else []

    def boundary_ids(self, last_token: Optional[int]) -> list[int]:
        """chat: what the template writes after an assistant turn's content and the engine did
        not produce: the text after its end-of-turn token, and the end-of-turn token itself
        when the turn ended otherwise (a stop string, a cut)."""
        prefix = self._tail
        if self._end_text and last_token != self.end_id:
            prefix = self._end_text + prefix
        return self.text_ids(prefix)

    def _single_id(self, text: str) -> Optional[int]:
        ids = self.text_ids(text)
        return ids[0] if len(ids) == 1 else None

    def _turn_end(self) -> tuple[str, str]:
        """(tail, end): what the template writes after the assistant's content: its
        end-of-turn token text (the tokenizer's eos when it appears there) and what follows it."""
        convo = [{"role": "user", "content": _PROBE_USER}, {"role": "assistant", "content": _PROBE_ASSISTANT}]
        text = self._render(convo)
        after = text[text.rindex(_PROBE_ASSISTANT) + len(_PROBE_ASSISTANT):]
        eos = getattr(self.tokenizer, "eos_token", None) or ""
        if eos and eos in after:
            cut = after.index(eos)
            return after[cut + len(eos):], after[:cut + len(eos)]
        return after, ""

    def delta_text(self, text: str) -> str:
        """chat: the template's text for one `role` message after an assistant turn's end,
        the assistant turn opened again (without the end-of-turn token and what precedes it)."""
        convo = [{"role": "user", "content": _PROBE_USER}, {"role": "assistant", "content": _PROBE_ASSISTANT}]
        before = self._render(convo)
        after = self._render(convo + [{"role": self.role, "content": text}], gen=True)
        if not after.startswith(before):
            raise ValueError("the chat template rewrites earlier turns when a message is added, so an "
                             "observation cannot be appended token-exactly: set env.template=text")
        return after[len(before):]

    def ids(self, text: str, last_token: Optional[int] = None) -> list[int]:
        """Token ids of observation `text` appended after a model turn ending in `last_token`."""
        if self.template == "text":
            return self.text_ids(text)
        return self.boundary_ids(last_token) + self.text_ids(self.delta_text(text))


def conversation_delta_ids(renderer: ObservationRenderer, before: list[dict], after: list[dict],
                           last_token: Optional[int] = None) -> list[int]:
    """chat: the ids to append when a conversation rendered as `before` (ending with the
    assistant turn the engine produced, its last token `last_token`) grows to `after`
    (`before` plus new non-assistant messages), with the next assistant turn opened. Raises
    ValueError when `after` does not extend `before` or the template rewrites history."""
    if renderer.template != "chat":
        raise ValueError("conversation deltas need a chat template (env.template=chat)")
    if after[:len(before)] != before or len(after) == len(before):
        raise ValueError("the messages do not extend the conversation recorded so far (an earlier "
                         "message was changed or removed, or nothing was added)")
    old = renderer._render(before)
    new = renderer._render(after, gen=True)
    if not new.startswith(old):
        raise ValueError("the chat template rewrites earlier turns when messages are added, so the "
                         "conversation cannot be extended token-exactly")
    # `old` ends with the end-of-turn text and its tail, which the engine stopped before
    return renderer.boundary_ids(last_token) + renderer.text_ids(new[len(old):])
