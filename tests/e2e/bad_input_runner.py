"""Runs `megarl` command lines in one process and records what each printed and returned.

The bad-input table (test_bad_inputs.py) has many cases that fail at different depths (the
recipe, the merged config, the world size, files, folders); starting torch and megatron
once for all of them keeps the table cheap. Each case must fail: one that starts training
would run to the end of its recipe.
usage: bad_input_runner.py CASES_JSON OUT_JSON   (CASES_JSON: [{"id", "argv", "env"}])
"""
import contextlib
import io
import json
import os
import sys
import traceback


def main(cases_path: str, out_path: str) -> None:
    from megarl.cli import main as cli
    results = {}
    for case in json.load(open(cases_path)):
        err, out = io.StringIO(), io.StringIO()
        old_env = {k: os.environ.get(k) for k in case.get("env", {})}
        os.environ.update(case.get("env", {}))
        try:
            with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
                try:
                    rc = cli(case["argv"])
                except SystemExit as exit_:   # argparse
                    rc = exit_.code
        except BaseException:  # noqa: BLE001 - an unhandled error is what the table looks for
            rc = None
            err.write(traceback.format_exc())
        finally:
            for k, v in old_env.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        results[case["id"]] = {"rc": rc, "stderr": err.getvalue(), "stdout": out.getvalue()}
    with open(out_path, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
