"""The parity table of the layout tests (tests/dist/parity.py) and the margins tool that reports
it (tools/parity_margins.py), on made-up histories."""
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "dist"))
sys.path.insert(0, str(ROOT / "tools"))

import parity  # noqa: E402
import parity_margins  # noqa: E402


def history(shift: float = 0.0, logp_shift: float = 0.0, steps: int = 2) -> list[dict]:
    """Made-up probe output: every scalar moved by `shift` relative, the logprobs by `logp_shift`."""
    out = []
    for step in range(steps):
        row = {k: (1.0 + step) * (1 + shift) for k in parity.SCALARS}
        row["logp"] = [-1.0 - logp_shift, -5.0 + logp_shift]
        if step == 0:
            row["logp_start"] = [-2.0 + logp_shift, -3.0]
        out.append(row)
    return out


def test_errors_are_in_units_of_each_tolerance():
    ref = history()
    half = parity.TOLERANCES["logp_start"].abs / 2
    errs = parity.errors(history(logp_shift=half), ref)
    assert errs["logp_start"] == pytest.approx(0.5)
    assert errs["logp"] == pytest.approx(half / parity.TOLERANCES["logp"].abs)
    assert errs["grad_norm"] == 0.0
    # a relative tolerance scales with the value; an absolute one does not
    moved = parity.errors(history(shift=1e-4), ref)
    assert moved["grad_norm"] == pytest.approx(1e-4 / parity.TOLERANCES["grad_norm"].rel)
    assert parity.error("logp", [0.0], [0.0, 1.0]) == float("inf")


def test_assert_parity_names_what_is_off_and_the_figures_it_was_set_from():
    ref = history()
    parity.assert_parity(history(shift=1e-7), ref)
    with pytest.raises(AssertionError, match=r"logp_start off by 10x its tolerance \(noise measured"):
        parity.assert_parity(history(logp_shift=10 * parity.TOLERANCES["logp_start"].abs), ref, what="x")
    with pytest.raises(AssertionError, match="2 steps against 1"):
        parity.assert_parity(history(), ref[:1])
    # a quantity the reference has and the run lacks is off, not skipped: a probe that stopped
    # reporting it would otherwise pass every comparison of it
    lacking = history()
    del lacking[1]["grad_norm"]
    with pytest.raises(AssertionError, match="grad_norm off by infx"):
        parity.assert_parity(lacking, ref)


def test_every_tolerance_keeps_the_figures_it_was_set_from():
    for key, tol in parity.TOLERANCES.items():
        assert tol.noise and tol.catch and (tol.abs > 0 or tol.rel > 0), key


def test_margins_report_the_worst_noise_and_each_real_error(capsys):
    ref = history()
    runs = {"ref": ref, "threads2": history(logp_shift=1e-6), "mbs1": history(logp_shift=4e-6),
            "mbs2": ref, "tp2": history(logp_shift=2e-6), "pp2": ref, "dp2": ref,
            "actor_lr_x1.01": history(shift=1e-2, logp_shift=3e-2), "critic_lr_x1.01": ref,
            "swapped_shard": history(shift=3e-2, logp_shift=0.5)}
    report = parity_margins.margins(runs)
    start = report["logp_start"]
    assert start["noise"]["by"] == "mbs1" and start["noise"]["abs"] == pytest.approx(4e-6)
    assert start["margin"] == pytest.approx(parity.TOLERANCES["logp_start"].abs / 4e-6)
    assert start["layouts"]["by"] == "tp2"
    assert report["grad_norm"]["real_errors"]["swapped_shard"]["rel"] == pytest.approx(3e-2)
    assert report["grad_norm"]["margin"] == float("inf")   # no noise at all in made-up scalars
    parity_margins.show(report)
    out = capsys.readouterr().out
    assert "logp_start" in out and "too tight" not in out
    runs["mbs1"] = history(logp_shift=parity.TOLERANCES["logp_start"].abs / 2)
    parity_margins.show(parity_margins.margins(runs))
    assert "too tight here" in capsys.readouterr().out
