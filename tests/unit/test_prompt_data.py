"""Prompt data: JSONL and parquet rows, text prompts and chat messages, and the error every
malformed row gets (it names the file, the row and the field). No model, a few seconds."""
from __future__ import annotations

import json

import pytest
from conftest import ROOT

from megarl.config import ConfigError
from megarl.data import countdown as cd
from megarl.data.prompts import check_chat_template, encode_prompts, load_prompts, prompt_text

SAMPLE = ROOT / "tests" / "data" / "math_sample.jsonl"
# the tiny model's tokenizer has no chat template; a minimal one for these tests
TEMPLATE = ("{% for m in messages %}<bos> {{ m['role'] }} : {{ m['content'] }} {% endfor %}"
            "{% if add_generation_prompt %}<bos> assistant :{% endif %}")


def sample_rows() -> list[dict]:
    return [json.loads(line) for line in SAMPLE.read_text().splitlines() if line.strip()]


def write_parquet(path, rows):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq
    # from_pylist would take the columns of the first row only; a struct array takes them all
    pq.write_table(pa.Table.from_struct_array(pa.array(rows)), path)
    return path


@pytest.fixture(scope="module")
def chat_tokenizer():
    tok = cd.build_tokenizer()
    tok.chat_template = TEMPLATE
    return tok


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_sample_file_has_text_and_chat_rows_with_answers():
    """The shipped sample: ~20 math rows, both kinds of prompt, every row with an answer."""
    records = load_prompts(str(SAMPLE), answer_key="answer")
    assert len(records) == 20
    assert sum("prompt" in r for r in records) == 10 and sum("messages" in r for r in records) == 10


def test_parquet_loads_the_same_records(tmp_path):
    """A parquet file of the sample's rows loads to the same records (messages as lists of dicts).
    pyarrow fills a column missing from a row with null: read back as a missing field."""
    path = write_parquet(tmp_path / "math.parquet", sample_rows())
    records = load_prompts(str(path), answer_key="answer")
    assert len(records) == 20
    for got, want in zip(records, sample_rows()):
        assert got == want


def test_messages_render_with_the_chat_template(chat_tokenizer):
    """Chat rows are rendered with the template (generation prompt added); text rows are used as is;
    encode_prompts tokenizes both without adding special tokens."""
    chat = {"messages": [{"role": "user", "content": "n3 n2"}], "answer": "1"}
    text = {"prompt": "<bos> n3 =", "answer": "n3 n2 n1"}
    assert prompt_text(chat, chat_tokenizer, "prompt", "messages") == "<bos> user : n3 n2 <bos> assistant :"
    assert prompt_text(text, chat_tokenizer, "prompt", "messages") == "<bos> n3 ="
    ids = encode_prompts(chat_tokenizer, [chat, text], "prompt", "messages")
    assert ids[1] == [cd.BOS_ID, cd.TOKEN_TO_ID["n3"], cd.TOKEN_TO_ID["="]]
    assert ids[0][0] == cd.BOS_ID and ids[0].count(cd.BOS_ID) == 2   # the template's, no extra
    check_chat_template([chat, text], "unused", "prompt", "messages", "x.jsonl", tokenizer=chat_tokenizer)


def test_messages_key_can_be_the_prompt_field(tmp_path, chat_tokenizer):
    """Datasets whose `prompt` column holds chat messages: data.messages_key=prompt."""
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": [{"role": "user", "content": "n1"}], "answer": "1"}])
    records = load_prompts(str(path), "prompt", "prompt", "answer")
    assert prompt_text(records[0], chat_tokenizer, "prompt", "prompt").endswith("assistant :")


def test_chat_rows_without_a_chat_template_name_messages_key():
    """The tiny model's tokenizer has no chat template: chat rows stop the run before any model is
    built, naming data.messages_key and the fixes."""
    records = load_prompts(str(SAMPLE))
    with pytest.raises(ConfigError) as e:
        check_chat_template(records, "artifacts/tiny_countdown", "prompt", "messages", str(SAMPLE),
                            tokenizer=cd.build_tokenizer())
    msg = str(e.value)
    assert "data.messages_key='messages'" in msg and "10 rows" in msg and "chat_template" in msg
    assert "data.prompt_key" in msg
    # text rows only: nothing to check, no tokenizer loaded
    check_chat_template([r for r in records if "prompt" in r], "/nonexistent", "prompt", "messages", "x")


GOOD = {"prompt": "What is 1+1?", "answer": "2"}
BAD_ROWS = [
    # (id, the bad second row, answer_key, text the message must hold besides file and row)
    ("not_json", '{"prompt": ', None, "not JSON"),
    ("no_prompt_field", {"question": "1+1?"}, None, "no field 'prompt' (data.prompt_key) nor 'messages'"),
    ("not_an_object", ["1+1?"], None, "data.prompt_key"),
    ("empty_prompt", {"prompt": "  "}, None, "field 'prompt' (data.prompt_key)"),
    ("prompt_not_text", {"prompt": 7}, None, "field 'prompt' (data.prompt_key)"),
    ("messages_empty", {"messages": []}, None, "field 'messages' (data.messages_key)"),
    ("messages_not_list", {"messages": "hi"}, None, "field 'messages' (data.messages_key)"),
    ("message_no_role", {"messages": [{"content": "hi"}]}, None, "field 'messages' (data.messages_key) has message 0"),
    ("message_content_not_text", {"messages": [{"role": "user", "content": 3}]}, None, "message 0"),
    ("no_answer", {"prompt": "1+1?"}, "answer", "no field 'answer' (data.answer_key)"),
    ("empty_answer", {"prompt": "1+1?", "answer": ""}, "answer", "field 'answer' (data.answer_key)"),
    ("answer_not_scalar", {"prompt": "1+1?", "answer": {"x": 1}}, "answer", "field 'answer' (data.answer_key)"),
]


# parquet can hold only some of them: a row is always an object of columns, and a column has
# one type (a number next to a text cannot be written)
PARQUET_CANNOT = {"not_json", "not_an_object", "prompt_not_text", "messages_not_list", "answer_not_scalar"}
CASES = [(c, fmt) for c in BAD_ROWS for fmt in ("jsonl", "parquet")
         if fmt == "jsonl" or c[0] not in PARQUET_CANNOT]


@pytest.mark.parametrize("case,fmt", CASES, ids=[f"{c[0]}-{fmt}" for c, fmt in CASES])
def test_malformed_row_names_file_row_and_field(tmp_path, case, fmt):
    """Every malformed row: a ConfigError naming data.prompts=<file>, the row number (JSONL: the
    line; parquet: the row from 1) and the field with its config key, and what to do."""
    _, bad, answer_key, must = case
    if fmt == "parquet":
        path = write_parquet(tmp_path / "bad.parquet", [GOOD, bad])
    else:
        path = write_jsonl(tmp_path / "bad.jsonl", [GOOD, bad])
    with pytest.raises(ConfigError) as e:
        load_prompts(str(path), answer_key=answer_key)
    msg = str(e.value)
    assert f"data.prompts={str(path)!r}, row 2" in msg, msg
    assert must in msg, msg
    assert "fix" in msg or "set data." in msg, msg


def test_missing_empty_and_unreadable_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="data.prompts"):
        load_prompts(str(tmp_path / "nope.jsonl"))
    with pytest.raises(ConfigError, match="holds no records"):
        load_prompts(str(write_jsonl(tmp_path / "empty.jsonl", [])))
    (tmp_path / "junk.parquet").write_text("not parquet")
    with pytest.raises(ConfigError, match="not a readable parquet file"):
        load_prompts(str(tmp_path / "junk.parquet"))


def test_answer_may_be_a_number(tmp_path):
    path = write_parquet(tmp_path / "n.parquet", [{"prompt": "1+1?", "answer": 2}])
    assert load_prompts(str(path), answer_key="answer")[0]["answer"] == 2
