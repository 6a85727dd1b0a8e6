"""Progress in a log file (a slurm job's trainer.log): plain lines, no carriage return, no
cursor code, for the training's step lines and the evaluation's progress alike."""
import io
import re

from megarl.metrics import progress
from megarl.metrics.logger import MetricsLogger

CONTROL = re.compile(r"[\r\x1b]")


def test_the_training_logger_writes_plain_step_lines_to_a_log_file(tmp_path, capsys):
    log = MetricsLogger(str(tmp_path), 3, tensorboard=False, progress=True)
    for step in range(3):
        log.log(step, {"reward_mean": 0.5, "step_time_s": 2.0})
    log.bar.write("resumed from somewhere")
    log.close()
    out = capsys.readouterr()
    text = out.out + out.err
    assert not CONTROL.search(text), repr(text[:300])
    lines = text.splitlines()
    assert [line.split("|")[0].strip() for line in lines if line.startswith("step")] == ["step    0", "step    1",
                                                                                           "step    2"]
    assert "resumed from somewhere" in lines


def test_a_plain_progress_line_every_few_seconds_and_none_in_between():
    now = [0.0]
    out = io.StringIO()
    bar = progress.progress_bar(10, "eval math", "sample", file=out, every_s=5.0)
    assert isinstance(bar, progress.PlainProgress)
    bar.clock = lambda: now[0]
    bar.last = 0.0
    bar.update(2)               # 0 s: too soon
    now[0] = 6.0
    bar.update(3)               # 6 s: one line
    now[0] = 7.0
    bar.update(1)               # 7 s: too soon again
    bar.close()
    assert out.getvalue() == "eval math: 5/10 sample (50%)\n"
    assert bar.n == 6


def test_a_terminal_still_gets_tqdm():
    class Tty(io.StringIO):
        def isatty(self):
            return True
    bar = progress.progress_bar(3, "x", "it", file=Tty())
    assert not isinstance(bar, progress.PlainProgress)
    bar.close()
