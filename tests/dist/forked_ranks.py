"""Fork a gloo world from one process that imported torch and megatron once, and collect what
each rank wrote (the probes' harness: push_errors_probe.py, sharded_push_probe.py).

`target(rank, port, out_dir, *args)` runs in each forked rank and writes its results to
`<out_dir>/rank<r>.json` as it goes; a rank still running `hang_s` after the start is killed and
reported as hung (a rank blocked in a collective would otherwise wait for its timeout)."""
import json
import multiprocessing as mp
import tempfile
import time
from pathlib import Path


def run_ranks(target, world: int, args: tuple, hang_s: float) -> dict:
    """{"ranks": {rank: what it wrote}, "hung": [ranks killed], "exitcodes": [...]}."""
    from megarl.distributed.env import free_port
    ctx, port = mp.get_context("fork"), free_port()
    with tempfile.TemporaryDirectory() as out_dir:
        procs = [ctx.Process(target=target, args=(r, port, out_dir, *args), daemon=True) for r in range(world)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + hang_s
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for r in hung:
            procs[r].kill()
        ranks = {r: (json.loads(f.read_text()) if (f := Path(out_dir, f"rank{r}.json")).exists() else {})
                 for r in range(world)}
    return {"ranks": ranks, "hung": hung, "exitcodes": [p.exitcode for p in procs]}
