"""A missing model folder or prompts file names the builder that makes it: the tiny agent's
(`make agent-model`, tools/make_tiny_agent_model.py) for artifacts/tiny_guess, the countdown
one's (`make model`, tools/make_tiny_model.py) for artifacts/tiny_countdown, both (saying which
builds what) for a path neither builds."""
import pytest

from megarl.config.errors import ConfigError
from megarl.data.prompts import load_prompts
from megarl.models.setup import check_model_dir

AGENT, COUNTDOWN = "tools/make_tiny_agent_model.py", "tools/make_tiny_model.py"


def message(fn, path) -> str:
    with pytest.raises((FileNotFoundError, ConfigError)) as err:
        fn(path)
    return str(err.value)


@pytest.mark.parametrize("check, path, setting", [
    (load_prompts, "{root}/artifacts/tiny_guess/prompts.jsonl", "data.prompts"),
    (lambda p: check_model_dir(p, "model.path"), "{root}/artifacts/tiny_guess", "model.path"),
])
def test_the_agent_tasks_files_name_the_agent_builder(tmp_path, check, path, setting):
    path = path.format(root=tmp_path)
    text = message(check, path)
    assert setting in text and "make agent-model" in text and AGENT in text, text
    assert COUNTDOWN not in text.replace(AGENT, ""), text
    assert f"--out {tmp_path}/artifacts/tiny_guess" in text, text


@pytest.mark.parametrize("check, path", [
    (load_prompts, "{root}/artifacts/tiny_countdown/prompts.jsonl"),
    (lambda p: check_model_dir(p, "model.path"), "{root}/artifacts/tiny_countdown"),
])
def test_the_countdown_files_name_the_countdown_builder(tmp_path, check, path):
    text = message(check, path.format(root=tmp_path))
    assert "make model" in text and COUNTDOWN in text and AGENT not in text, text


def test_a_path_no_builder_makes_names_both_and_what_each_builds(tmp_path):
    text = message(load_prompts, str(tmp_path / "mine" / "data.jsonl"))
    assert COUNTDOWN in text and AGENT in text and "countdown" in text and "guess" in text, text
