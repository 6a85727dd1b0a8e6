"""`megarl eval` (megarl/evaluate.py): its inputs refused in one line, exit 2, before anything
starts (the scoring itself is the Evaluator's, tests/unit/test_eval_runner.py)."""
import pytest

from megarl import cli

HELD = "eval.datasets=[held=artifacts/tiny_countdown/eval.jsonl]"
MODEL = "MODEL"   # replaced by a folder with a config.json (the checks read nothing else)


@pytest.mark.parametrize("args,says", [
    ([HELD], "give the model to score"),
    (["--model", MODEL, "--run", "runs/x", HELD], "give the model to score"),
    (["--model", MODEL, "--step", "3", HELD], "--step picks a checkpoint of --run"),
    (["--model", "nowhere", HELD], "--model 'nowhere': no config.json there"),
    (["--run", "nowhere", HELD], "--run 'nowhere': no such folder"),
    (["--model", MODEL], "lists no eval.datasets"),
    (["--model", MODEL, HELD, "rollout.engines.mode=remote", "rollout.engines.urls=[http://node1:8000]"],
     "rollout.engines.mode=remote: megarl eval starts its engines"),
])
def test_bad_inputs_are_one_line_and_exit_2(args, says, tmp_path, capsys):
    args = [model_dir(tmp_path) if a == MODEL else a for a in args]
    assert cli.main(["eval", "recipes/tiny_cpu.yaml", "--out", str(tmp_path / "out"), *args]) == 2
    err = capsys.readouterr().err.strip()
    assert says in err and "\n" not in err, err
    assert not (tmp_path / "out").exists()   # nothing written


def model_dir(tmp_path) -> str:
    (tmp_path / "m").mkdir(exist_ok=True)
    (tmp_path / "m" / "config.json").write_text("{}")
    return str(tmp_path / "m")


def test_an_output_folder_with_metrics_is_not_overwritten(tmp_path, capsys):
    (tmp_path / "metrics.jsonl").write_text("{}\n")
    assert cli.main(["eval", "recipes/tiny_cpu.yaml", "--out", str(tmp_path), "--model", model_dir(tmp_path),
                     HELD]) == 2
    assert "holds a metrics.jsonl already" in capsys.readouterr().err


def test_out_is_required(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["eval", "recipes/tiny_cpu.yaml", "--model", MODEL])
    assert exit_.value.code == 2 and "--out" in capsys.readouterr().err
