"""A record's prompt as the model sees it (docs/data.md, "Prompt format"): the text as is, or
the chat messages (with data.system_prompt first) rendered with the tokenizer's chat template,
data.chat_template_kwargs passed to it; token ids with the BOS the tokenizer puts before a text
(Llama's) and none added to a rendered chat (its template writes its own).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from megarl.config.errors import ConfigError

# apply_chat_template's own arguments: megarl sets them, data.chat_template_kwargs may not
RESERVED_KWARGS = ("conversation", "messages", "tokenize", "add_generation_prompt", "return_dict",
                   "continue_final_message", "chat_template")


@dataclass
class PromptFormat:
    """How records become prompts: data.prompt_key / messages_key / system_prompt /
    chat_template_kwargs."""
    prompt_key: str = "prompt"
    messages_key: str = "messages"
    system_prompt: str = ""
    chat_template_kwargs: dict = field(default_factory=dict)


def as_format(key, messages_key: str = "messages") -> PromptFormat:
    """A PromptFormat from one, from a DataConfig (anything with its fields), or from the two
    field names (the callers that give only those: no system prompt, no template options)."""
    if isinstance(key, PromptFormat):
        return key
    if isinstance(key, str):
        return PromptFormat(key, messages_key)
    return PromptFormat(key.prompt_key, getattr(key, "messages_key", "messages"),
                        getattr(key, "system_prompt", "") or "", dict(getattr(key, "chat_template_kwargs", None) or {}))


def chat_messages(record: dict, fmt: PromptFormat) -> list | None:
    """The record's chat (data.system_prompt first where it opens with no system message), or
    None for a text prompt. A list under the prompt field is a chat too (veRL's rows)."""
    prompt = record.get(fmt.prompt_key)
    if isinstance(prompt, str):
        return None
    messages = prompt if isinstance(prompt, list) else record[fmt.messages_key]
    if fmt.system_prompt and not (messages and messages[0].get("role") == "system"):
        messages = [{"role": "system", "content": fmt.system_prompt}, *messages]
    return messages


def prompt_text(record: dict, tokenizer, prompt_key, messages_key: str = "messages") -> str:
    """The text to tokenize: the prompt field, or the messages rendered with the tokenizer's
    chat template and the assistant's turn opened (add_generation_prompt). `prompt_key`: a
    field name, a PromptFormat or the DataConfig."""
    fmt = as_format(prompt_key, messages_key)
    messages = chat_messages(record, fmt)
    if messages is None:
        return record[fmt.prompt_key]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False,
                                         **fmt.chat_template_kwargs)


def text_bos(tokenizer) -> int | None:
    """The BOS id the tokenizer puts before a text it encodes with its special tokens (Llama's
    tokenizers; None for those that put none, Qwen's). Probed, as tokenizers say it in several
    ways (add_bos_token, a post-processor template)."""
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        return None
    try:
        ids = tokenizer(["x"], add_special_tokens=True)["input_ids"][0]
    except Exception:   # noqa: BLE001 - a tokenizer that cannot say: add nothing
        return None
    return bos if list(ids[:1]) == [bos] else None


def encode_prompts(tokenizer, records: list[dict], key, messages_key: str = "messages",
                   batch: bool = False) -> list[list[int]]:
    """Token ids of each record's prompt (`prompt_text`; `key` as there). A text prompt gets the
    BOS its tokenizer would add (`text_bos`) unless it starts with it; a rendered chat is
    encoded as is (its template writes the BOS where the model wants one); nothing else added.
    `batch`: one tokenizer call for all (the whole dataset at start), else one per record."""
    fmt = as_format(key, messages_key)
    if not records:
        return []
    texts = [prompt_text(r, tokenizer, fmt) for r in records]
    if batch:
        ids = [list(x) for x in tokenizer(texts, add_special_tokens=False)["input_ids"]]
    else:
        ids = [list(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts]
    bos = text_bos(tokenizer)
    if bos is not None:
        for i, r in enumerate(records):
            if isinstance(r.get(fmt.prompt_key), str) and ids[i][:1] != [bos]:
                ids[i] = [bos, *ids[i]]
    return ids


def check_chat_template(records: list[dict], model_path: str, prompt_key, messages_key: str,
                        path, tokenizer=None, setting: str = "data.prompts") -> None:
    """Chat rows need a tokenizer with a chat template: checked (and the first chat row rendered)
    before any model is built. Loads the tokenizer of `model_path` only when there is a chat row.
    data.system_prompt / chat_template_kwargs (in a PromptFormat or DataConfig as `prompt_key`)
    act on chat rows only: set with none, one line."""
    fmt = as_format(prompt_key, messages_key)
    first = next((i for i, r in enumerate(records) if not isinstance(r.get(fmt.prompt_key), str)), None)
    where = records.where(first or 0, setting) if getattr(records, "files", None) else f"{setting}={path!r}"
    file, _, row = where.rpartition(", row ")   # "data.prompts='f.jsonl'" and the row, when known
    if first is None:
        for name in ("system_prompt", "chat_template_kwargs"):
            if getattr(fmt, name):
                raise ConfigError(f"data.{name}={getattr(fmt, name)!r} acts on chat rows, and {setting} holds "
                                  f"only text prompts (tokenized as they are): give the rows chat messages "
                                  f"(tools/prep_gsm8k.py --chat), or remove data.{name}")
        return
    bad = next((k for k in fmt.chat_template_kwargs if k in RESERVED_KWARGS), None)
    if bad:
        raise ConfigError(f"data.chat_template_kwargs: {bad!r} is set by megarl itself: remove it (give only the "
                          f"template's own variables, e.g. {{enable_thinking: false}})")
    if tokenizer is None:   # transformers is heavy: only chat rows without a tokenizer at hand need it
        from transformers import AutoTokenizer
        tokenizer = AutoTokenizer.from_pretrained(model_path)
    chats = sum(not isinstance(r.get(fmt.prompt_key), str) for r in records)
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError(f"data.messages_key={fmt.messages_key!r}: {chats} rows of {file or where} hold chat "
                          f"messages{f' (the first: row {row})' if file else ''}, but the tokenizer of model.path="
                          f"{model_path!r} has no chat template: add a \"chat_template\" to its "
                          f"tokenizer_config.json, use a chat model, or give the rows a prompt text "
                          f"(data.prompt_key={fmt.prompt_key!r})")
    try:
        prompt_text(records[first], tokenizer, fmt)
    except Exception as err:   # jinja raises its own types (e.g. a template's raise_exception)
        raise ConfigError(f"data.messages_key={fmt.messages_key!r}: the chat template of model.path={model_path!r} "
                          f"cannot render the first chat row ({where}) with data.chat_template_kwargs="
                          f"{fmt.chat_template_kwargs} ({err}): fix the messages (roles, order), the "
                          f"template or the options") from None
