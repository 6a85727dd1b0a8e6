"""The audit of a run's sample dumps (rollout.dump_every=1: every trained sample is in
`<run.dir>/samples/step_<N>.jsonl`, megarl/rollout/controller/dump.py), shared by the end-to-end tests
that break engines under a run: nothing cut off by a failure is trained as if it were whole."""
import json

ENDED = ("stop", "length")          # a response that ended on its own or on its token budget
REFUSED = "refused"                  # a request the engine refused as invalid (no response, reward 0)


def audit_dumps(run_dir, steps: int, max_new_tokens: int) -> dict[int, list[dict]]:
    """Every sample of steps 0..steps-1, by step, after checking each one: its finish reason is
    stop, length or refused (never abort: a cut-off sample trained as final); its response ids,
    logprobs and versions are aligned; a response ended by its budget holds exactly the budget
    and any other at most it; versions never go back within a sample; a refused sample has no
    response and reward 0. The message names the step, the row and the problem."""
    out = {}
    for step in range(steps):
        path = run_dir / "samples" / f"step_{step}.jsonl"
        assert path.exists(), f"step {step} trained but its samples were not dumped ({path})"
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        assert rows, f"{path}: no sample"
        for i, s in enumerate(rows):
            where, reason, n = f"{path.name} row {i}", s["finish_reason"], len(s["response_ids"])
            assert reason in ENDED + (REFUSED,), f"{where}: trained with finish_reason {reason!r} after {n} tokens"
            assert n == len(s["logprobs"]) == len(s["versions"]), \
                f"{where}: {n} tokens, {len(s['logprobs'])} logprobs, {len(s['versions'])} versions"
            if reason == REFUSED:
                assert n == 0 and s["reward"] == 0.0, f"{where}: refused with {n} tokens, reward {s['reward']}"
                continue
            assert 1 <= n <= max_new_tokens, f"{where}: {n} tokens, budget {max_new_tokens}"
            assert reason != "length" or n == max_new_tokens, f"{where}: ended by length after {n} of {max_new_tokens}"
            assert s["versions"] == sorted(s["versions"]), f"{where}: versions go back: {s['versions']}"
        out[step] = rows
    return out
