"""What tests/unit/test_service.py drives the agent service with: a word-level chat tokenizer
built in memory, and an engine answering from a fixed table (unit tests only).

Tokenizer: every word of `WORDS` is one token; the chat template writes each message as
`<role> content <eos> <nl>` after `<bos>`, and opens the assistant turn with `<assistant>`.
`<nl>` is the text after the end-of-turn token, which the engine never produces (Qwen's "\\n"
after <|im_end|>): the service must put it back in front of the next message's ids.

Engine: the reply to a prompt depends only on how many assistant turns the prompt holds (the
turn number) and how many of that turn's tokens are already at its end (a continuation after an
abort), so a lost, repeated or misplaced token shows. `REPLIES[turn % len(REPLIES)]` are the
words of turn `turn`, then `<eos>`. Token j of a turn has behaviour logprob
-(0.1 * (j + 1) + 0.01 * turn), stamped with the engine's weight version when sampled.

`ServiceHarness`: an engine, its pool and the agent service on a LoopThread, as the trainer
runs them; `harnesses` is the body of a test module's fixture that builds them.
"""
from __future__ import annotations

import asyncio
import threading

from megarl.rollout.engines.engine import Engine, EngineError, EngineHealth, GenResult, copy_result
from megarl.rollout.engines.pool import EnginePool, LoopThread
from megarl.service import AgentService

SPECIALS = ["<pad>", "<bos>", "<eos>", "<unk>", "<system>", "<user>", "<assistant>", "<tool>"]
WORDS = ["<nl>", "hello", "world", "the", "answer", "is", "four", "five", "six", "try", "again",
         "ok", "plan", "step", "one", "two", "three", "done", "what", "next"]
VOCAB = {tok: i for i, tok in enumerate(SPECIALS + WORDS)}
PAD, BOS, EOS, UNK = (VOCAB[t] for t in ("<pad>", "<bos>", "<eos>", "<unk>"))
SYSTEM, USER, ASSISTANT, TOOL, NL = (VOCAB[t] for t in ("<system>", "<user>", "<assistant>", "<tool>", "<nl>"))

CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }} <eos> <nl> "
                 "{% endfor %}{% if add_generation_prompt %}<assistant> {% endif %}")

REPLIES = [["the", "answer", "is", "four"], ["try", "again", "five"], ["plan", "step", "one", "two", "three"]]


def ids(text: str) -> list[int]:
    """Hand-side encoding of space-separated vocabulary words (the tests' expected values)."""
    return [VOCAB[w] for w in text.split()]


def reply_ids(turn: int) -> list[int]:
    return ids(" ".join(REPLIES[turn % len(REPLIES)])) + [EOS]


def reply_logprob(turn: int, j: int) -> float:
    return -(0.1 * (j + 1) + 0.01 * turn)


def build_tokenizer():
    """The word-level chat tokenizer (a PreTrainedTokenizerFast with CHAT_TEMPLATE)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab=dict(VOCAB), unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)   # join words with one space
    tok.add_special_tokens(SPECIALS)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>",
                                 pad_token="<pad>", unk_token="<unk>", clean_up_tokenization_spaces=False)
    hf.chat_template = CHAT_TEMPLATE
    return hf


def turn_position(prompt: list[int]) -> tuple[int, int]:
    """(turn number, tokens of that turn already in the prompt): the prompt's assistant
    markers after the first one count finished turns; what follows the last one is this
    turn's prefix."""
    marks = [i for i, t in enumerate(prompt) if t == ASSISTANT]
    if not marks:
        raise ValueError(f"prompt without an <assistant> marker: {prompt}")
    return len(marks) - 1, len(prompt) - marks[-1] - 1


class TableEngine(Engine):
    """Answers from REPLIES, one token per `step_s`; pause, abort and version stamping as the
    engine contract says. `stall_after=k`: a request stops after k tokens of its turn and
    waits there (until aborted or `unstall()`), and `stalled` is set: a test can then push
    weights while the request is known to be in flight."""

    def __init__(self, name: str = "table0", step_s: float = 0.0):
        self.name, self.step_s = name, step_s
        self.version, self.paused = 0, False
        self.log: list[tuple[str, list[int], int]] = []   # (key, prompt_ids, max_tokens) per generate
        self.stall_after: int | None = None
        self.stalled = threading.Event()
        self._unstall = asyncio.Event()
        self._running: dict[str, GenResult] = {}
        self._abort: set[str] = set()
        self._ended: dict[str, asyncio.Event] = {}
        self.kv_cleared = 0

    async def start(self):
        pass

    @property
    def running(self):
        return len(self._running)

    def unstall(self, loop) -> None:
        """From another thread: let stalled requests go on."""
        self.stall_after = None
        loop.call_soon_threadsafe(self._unstall.set)

    async def _wait_turn(self, key: str, done_in_turn: int) -> None:
        if self.stall_after is not None and done_in_turn >= self.stall_after:
            self.stalled.set()
            while key not in self._abort and not self._unstall.is_set():
                await asyncio.sleep(0.005)
        await asyncio.sleep(self.step_s)
        while self.paused and key not in self._abort:
            await asyncio.sleep(0.005)

    async def generate(self, req):
        self.log.append((req.key, list(req.prompt_ids), req.max_tokens))
        turn, before = turn_position(req.prompt_ids)
        reply = reply_ids(turn)
        res = GenResult(req.key, engine=self.name)
        self._running[req.key], self._ended[req.key] = res, asyncio.Event()
        try:
            while len(res.token_ids) < req.max_tokens:
                j = before + len(res.token_ids)
                if j >= len(reply):
                    raise EngineError(f"engine {self.name}: prompt runs past the end of reply {turn}")
                await self._wait_turn(req.key, j)
                if req.key in self._abort:
                    res.finish_reason = "abort"
                    return res
                res.extend([reply[j]], [reply_logprob(turn, j)], self.version)
                if reply[j] == EOS:
                    res.finish_reason = "stop"
                    return res
            res.finish_reason = "length"
            return res
        finally:
            del self._running[req.key]
            self._abort.discard(req.key)
            self._ended.pop(req.key).set()

    async def abort(self, keys=None):
        keys = list(self._running) if keys is None else [k for k in keys if k in self._running]
        self._abort.update(keys)
        waits = [self._ended[k].wait() for k in keys if k in self._ended]
        if waits:
            await asyncio.gather(*waits)

    async def pause(self):
        self.paused = True

    async def resume(self):
        self.paused = False

    def partial(self, key):
        res = self._running.get(key)
        return None if res is None else copy_result(res)

    async def clear_kv(self):
        self.kv_cleared += len(self._running)   # held requests recompute nothing here: tokens are a table

    async def reload_weights(self, path, version):
        if not self.paused:
            raise EngineError(f"engine {self.name}: a weight update needs the engine paused")
        self.version = version

    async def health(self):
        return EngineHealth(self.name, True, self.paused, self.running, self.version)

    async def close(self):
        pass


class ServiceHarness:
    """`engine` in a pool (`pool_options`) and an AgentService over it (`settings` over a small
    default) on a LoopThread named `loop_name`; record i of the task stream has uid 100 + i."""

    def __init__(self, tokenizer, engine: Engine, loop_name: str, pool_options: dict, **settings):
        self.loop = LoopThread(loop_name)
        self.engine = engine
        self.pool = EnginePool([engine], timeout_s=10, **pool_options)
        self.drawn = 0
        options = dict(n=2, max_episodes=8, max_new_tokens=64, seed=3, episode_timeout_s=30.0, max_model_len=4096)
        self.service = AgentService(self.pool, tokenizer, next_task=self.next_task, **{**options, **settings})
        self.loop.run(self.pool.start(), 10)
        self.loop.run(self.service.start(), 10)

    def next_task(self):
        self.drawn += 1
        return {"prompt": f"task {self.drawn - 1}"}, 100 + self.drawn - 1

    def close(self):
        try:
            self.loop.run(self.service.close(), 10)
            self.loop.run(self.pool.close(), 10)
        finally:
            self.loop.stop()


def harnesses(cls, tokenizer):
    """A fixture's body (`yield from`): the test builds harnesses with `build(**kw)`; each is
    closed when the test ends."""
    made = []

    def build(**kw):
        made.append(cls(tokenizer, **kw))
        return made[-1]
    yield build
    for h in made:
        h.close()
