"""Prompt datasets and a resumable, seeded sampler over them.

A dataset is a JSONL or parquet file (docs/data.md); each row holds the prompt as text
(`data.prompt_key`) or as chat messages (`data.messages_key`, rendered with the tokenizer's chat
template when encoded), and, for verifiers that need one, a gold answer (`data.answer_key`).
Rows are checked once at load, so a bad row stops the run before anything expensive starts.
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path

from megarl.config.errors import ConfigError
from megarl.data.builders import how_to_build
from megarl.data.seeds import epoch_shuffle_seed


class Records(list):
    """The dataset's records, with the file's row number of each (`rows[i]`, as error
    messages name them: JSONL line numbers, parquet rows from 1)."""

    def __init__(self, *args):
        super().__init__(*args)
        self.rows: list[int] = []


def load_prompts(path: str, prompt_key: str = "prompt", messages_key: str = "messages",
                 answer_key: str | None = None, setting: str = "data.prompts") -> list[dict]:
    """Records of a .jsonl or .parquet file. Each row must hold `prompt_key` (a non-empty text)
    or `messages_key` (a non-empty list of {"role", "content"} texts); with `answer_key` set
    (the verifier needs a gold answer) also that field, a text or a number. Errors name the
    file as `setting` (the setting that gave it)."""
    p = Path(path)
    if p.is_dir():
        raise FileNotFoundError(f"{setting}={path!r} is a folder: point it at a .jsonl or .parquet file in it")
    if not p.is_file():
        raise FileNotFoundError(f"{setting}={path!r} does not exist: {how_to_build(path)}, or point "
                                f"{setting} at a .jsonl or .parquet file")
    records = Records()
    for row, rec in _rows(p, path, setting):
        _check_row(rec, path, row, prompt_key, messages_key, answer_key, setting)
        records.append(rec)
        records.rows.append(row)
    if not records:
        raise ConfigError(f"{setting}={path!r} holds no records: point it at a .jsonl file with one "
                          f"{{\"{prompt_key}\": ...}} object per line, or a .parquet file with rows")
    return records


def _rows(p: Path, path: str, setting: str):
    """(row number, record) pairs: JSONL rows are line numbers (blank lines skipped), parquet
    rows count from 1."""
    if p.suffix.lower() == ".parquet":
        try:   # here: only parquet datasets need pyarrow
            import pyarrow.parquet as pq
        except ImportError:
            raise ConfigError(f"{setting}={path!r}: reading parquet needs pyarrow (a megarl "
                              f"dependency): `pip install pyarrow`, or give a .jsonl file") from None
        try:
            table = pq.read_table(p)
        except Exception as err:   # pyarrow raises several types for a file that is not parquet
            raise ConfigError(f"{setting}={path!r}: not a readable parquet file ({err}): "
                              f"rewrite it, or give a .jsonl file") from None
        # a column holds a null where a row has no such field (mixed text and chat rows):
        # a missing field, as in JSONL
        for row, rec in enumerate(table.to_pylist(), 1):
            yield row, {k: v for k, v in rec.items() if v is not None}
        return
    try:
        with p.open(encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except ValueError as err:
                    hint = (" (the file looks like one JSON array or object: write one JSON object per "
                            "line, JSONL)") if line.strip() in ("[", "{") else ""
                    raise ConfigError(f"{setting}={path!r}, row {lineno}: not JSON ({err}){hint}: fix or "
                                      f"remove that row") from None
                yield lineno, rec
    except UnicodeDecodeError as err:
        raise ConfigError(f"{setting}={path!r}: not a text file ({err.reason} at byte {err.start}): give a "
                          f"UTF-8 .jsonl file (one JSON object per line) or a .parquet file") from None


def _check_row(rec, path: str, row: int, prompt_key: str, messages_key: str, answer_key: str | None,
               setting: str) -> None:
    where = f"{setting}={path!r}, row {row}"
    if not isinstance(rec, dict) or (prompt_key not in rec and messages_key not in rec):
        fields = sorted(rec) if isinstance(rec, dict) else type(rec).__name__
        raise ConfigError(f"{where}: no field {prompt_key!r} (data.prompt_key) nor {messages_key!r} "
                          f"(data.messages_key); the row has {fields}: set data.prompt_key / "
                          f"data.messages_key or fix the row")
    if isinstance(rec.get(prompt_key), str) or messages_key not in rec:
        # a text prompt (it wins over messages when a row holds both)
        if not isinstance(rec[prompt_key], str) or not rec[prompt_key].strip():
            raise ConfigError(f"{where}: field {prompt_key!r} (data.prompt_key) is {rec[prompt_key]!r}, "
                              f"not a non-empty text: fix the row")
    else:
        problem = _messages_problem(rec[messages_key])
        if problem:
            raise ConfigError(f"{where}: field {messages_key!r} (data.messages_key) {problem}: fix the row, "
                              f"a list of {{\"role\": ..., \"content\": ...}} objects with texts, e.g. "
                              f"[{{\"role\": \"user\", \"content\": \"What is 1+1?\"}}]")
    if answer_key is not None:
        if answer_key not in rec:
            raise ConfigError(f"{where}: no field {answer_key!r} (data.answer_key), which the verifier "
                              f"reward.fn needs; the row has {sorted(rec)}: set data.answer_key or fix the row")
        answer = rec[answer_key]
        if isinstance(answer, bool) or not isinstance(answer, (str, int, float)) or not str(answer).strip():
            raise ConfigError(f"{where}: field {answer_key!r} (data.answer_key) is {answer!r}, not a "
                              f"non-empty text or number: fix the row")


def _messages_problem(messages) -> str:
    """Why `messages` is not a chat (empty when it is one)."""
    if not isinstance(messages, list) or not messages:
        return f"is {messages!r}, not a non-empty list"
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            return f"has message {i} = {m!r}, not a {{\"role\": text, \"content\": text}} object"
    return ""


def prompt_text(record: dict, tokenizer, prompt_key: str, messages_key: str) -> str:
    """The text to tokenize: the prompt field, or the messages rendered with the tokenizer's
    chat template and the assistant's turn opened (add_generation_prompt)."""
    text = record.get(prompt_key)
    if isinstance(text, str):
        return text
    return tokenizer.apply_chat_template(record[messages_key], add_generation_prompt=True, tokenize=False)


def encode_prompts(tokenizer, records: list[dict], key: str, messages_key: str = "messages") -> list[list[int]]:
    """Token ids of each record's prompt: the text field `key`, or the chat `messages_key`
    rendered with the tokenizer's chat template (`prompt_text`). No special tokens are added:
    prompts and chat templates carry their own."""
    return [tokenizer(prompt_text(r, tokenizer, key, messages_key), add_special_tokens=False)["input_ids"]
            for r in records]


def check_chat_template(records: list[dict], model_path: str, prompt_key: str, messages_key: str,
                        path: str, tokenizer=None, setting: str = "data.prompts") -> None:
    """Chat rows need a tokenizer with a chat template: checked (and the first chat row rendered)
    before any model is built. Loads the tokenizer of `model_path` only when there is a chat row."""
    first = next((r for r in records if not isinstance(r.get(prompt_key), str)), None)
    if first is None:
        return
    if tokenizer is None:   # transformers is heavy: only chat rows without a tokenizer at hand need it
        from transformers import AutoTokenizer
        tokenizer = AutoTokenizer.from_pretrained(model_path)
    chats = sum(not isinstance(r.get(prompt_key), str) for r in records)
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError(f"data.messages_key={messages_key!r}: {chats} rows of {setting}={path!r} hold chat "
                          f"messages, but the tokenizer of model.path={model_path!r} has no chat template: "
                          f"add a \"chat_template\" to its tokenizer_config.json, use a chat model, or give "
                          f"the rows a prompt text (data.prompt_key={prompt_key!r})")
    try:
        prompt_text(first, tokenizer, prompt_key, messages_key)
    except Exception as err:   # jinja raises its own types (e.g. a template's raise_exception)
        raise ConfigError(f"data.messages_key={messages_key!r}: the chat template of model.path={model_path!r} "
                          f"cannot render the first chat row of {setting}={path!r} ({err}): fix the "
                          f"messages (roles, order) or the template") from None


@dataclass
class PromptSampler:
    """Walks the dataset in epochs, reshuffled per epoch from (seed, epoch); its state is two
    integers, so a resumed run draws exactly the prompts an uninterrupted one would."""
    size: int
    seed: int
    shuffle: bool = True
    epoch: int = 0
    cursor: int = 0
    _order: list = field(default=None, repr=False)

    def _epoch_order(self) -> list[int]:
        order = list(range(self.size))
        if self.shuffle:
            random.Random(epoch_shuffle_seed(self.seed, self.epoch)).shuffle(order)
        return order

    def take(self, k: int) -> list[int]:
        out = []
        while len(out) < k:
            if self._order is None:
                self._order = self._epoch_order()
            if self.cursor == self.size:
                self.epoch, self.cursor, self._order = self.epoch + 1, 0, None
                continue
            out.append(self._order[self.cursor])
            self.cursor += 1
        return out

    @property
    def drawn(self) -> int:
        """Prompts taken so far (a resumed sampler counts those before its checkpoint)."""
        return self.epoch * self.size + self.cursor

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "cursor": self.cursor}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.cursor, self._order = state["epoch"], state["cursor"], None
