"""`megarl` command line: parse, then dispatch (the work lives elsewhere)."""
from __future__ import annotations

import argparse
import os
import sys

# OpenMP's default busy-wait makes torch ~10x slower on shared 2-core machines when another
# process (the vLLM engine, another rank) is busy; must be set before torch is imported.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# vLLM logs every weight reload at INFO/WARNING; keep the console to megarl's progress lines
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")

from megarl.config import ConfigError, load_config  # noqa: E402 - after the environment above: it may import torch


def quiet_known_warnings() -> None:
    """Warnings that are expected on the CPU path and say nothing actionable to a user."""
    import warnings
    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"(torch\.distributed|vllm)\.")
    warnings.filterwarnings("ignore", message=r"The \.grad attribute of a Tensor that is not a leaf")


def _debug() -> bool:
    """MEGARL_DEBUG=1: handled errors show their traceback too (for bug reports)."""
    return os.environ.get("MEGARL_DEBUG") == "1"


def _parser() -> argparse.ArgumentParser:
    """The command line: one subcommand per job."""
    parser = argparse.ArgumentParser(prog="megarl", description="RL post-training of LLMs on megatron-core + vLLM")
    parser.add_argument("--version", action="version", version=f"megarl {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("doctor", help="the versions this machine has and the features megarl needs (exit 1: missing)")
    ck = sub.add_parser("check", help="every check `megarl train` makes before its first step, then exit")
    ck.add_argument("recipe")
    ck.add_argument("overrides", nargs="*")
    tr = sub.add_parser("train", help="run PPO/GRPO from a recipe")
    tr.add_argument("recipe", help="YAML recipe, e.g. recipes/tiny_cpu.yaml")
    tr.add_argument("overrides", nargs="*", help="key=value overrides, e.g. train.steps=10 run.dir=runs/x")
    pl = sub.add_parser("plan", help="placement and memory per GPU of a recipe on its cluster (docs/plan.md)")
    pl.add_argument("recipe")
    pl.add_argument("overrides", nargs="*")
    pl.add_argument("--nodes", type=int, help="nodes instead of cluster.nodes (the trainer:engine split scales)")
    pl.add_argument("--gpus-per-node", type=int, help="instead of cluster.gpus_per_node")
    pl.add_argument("--gpu-mem-gb", type=float, help="GiB per GPU instead of cluster.gpu_mem_gb")
    pl.add_argument("--json", action="store_true", help="the plan as JSON (fits, per_gpu_bytes by role, ...)")
    pl.add_argument("--config", action="store_true",
                    help="print the resolved config (YAML) with the plan as comments after it")
    pl.add_argument("--search", action="store_true",
                    help="rank trainer/engine node splits, engine TP and concurrency by simulated throughput")
    sm = sub.add_parser("simulate", help="project a recipe's step time on simulated hardware (docs/simulator.md)")
    sm.add_argument("recipe")
    sm.add_argument("overrides", nargs="*")
    sm.add_argument("--lengths", default="", help="response lengths: lognormal:mu=M,sigma=S | pareto:alpha=A,"
                    "xmin=X | fixed:len=L (default: lognormal, median max_new_tokens / 4, sigma 1; printed)")
    sm.add_argument("--calibration", default="", help="a bench/rollout_speedup.py result JSON (this machine)")
    sm.add_argument("--gpu", default="h100", help="roofline GPU when no --calibration: h100 | h200")
    sm.add_argument("--model", default="",
                    help="roofline model: a file of recipes/models/ (llama3.1-70b, qwen2.5-7b, ...); "
                         "default: the recipe's own model")
    sm.add_argument("--engine-tp", type=int, default=0, help="GPUs per engine (default: rollout.engines.tp)")
    sm.add_argument("--trainer-gpus", type=int, default=0,
                    help="trainer GPUs (default: the recipe's cluster: trainer nodes x gpus_per_node, else 8)")
    sm.add_argument("--steps", type=int, default=10)
    sm.add_argument("--json", action="store_true")
    from megarl.checkpoint import export_cli  # light: imports the converters only when it runs
    export_cli.add_parser(sub)
    from megarl import evaluate  # light: imports the engines and the evaluation only when it runs
    evaluate.add_parser(sub)
    return parser


def main(argv=None) -> int:
    parser = _parser()
    # key=value overrides may come after the options too (`--json train.steps=3`)
    args, extra = parser.parse_known_args(argv)
    stray = [a for a in extra if a.startswith("-") or "=" not in a]
    if stray:
        parser.error(f"unrecognized arguments: {' '.join(stray)}")
    args.overrides = list(getattr(args, "overrides", [])) + extra
    quiet_known_warnings()
    if args.command == "doctor":
        from megarl import doctor  # light: reads versions and vLLM's source, never imports megatron
        return doctor.main()
    if args.command == "export":
        from megarl.checkpoint import export_cli
        return export_cli.main(args)

    try:
        cfg = load_config(args.recipe, args.overrides)
    except ConfigError as err:
        return _explain(err, "config error", 2)
    if args.command == "simulate":
        return _simulate(cfg, args)
    if args.command == "plan":
        return _plan(cfg, args)
    # `megarl train` runs in every rank (torchrun): the shim first, then what imports megatron
    from megarl.bootstrap import bootstrap
    bootstrap()
    explained = _explained()
    try:
        if args.command == "check":
            from megarl import check
            return check.main(cfg)
        if args.command == "eval":
            from megarl import evaluate
            return evaluate.main(cfg, args)
        from megarl import preflight
        from megarl.train import train
        preflight.check_backends(cfg)   # before train() builds the process group
        train(cfg)
    except KeyboardInterrupt:  # engines and servers were stopped on the way out
        print("megarl: interrupted; the newest complete checkpoint is where a rerun resumes",
              file=sys.stderr)
        return 130
    except tuple(explained) as err:
        what, code = next(v for t, v in explained.items() if isinstance(err, t))
        # an engine error caused by the input (a remote URL where no server ever answered)
        # exits 2 like the other bad inputs
        return _explain(err, what, getattr(err, "exit_code", code))
    return 0


def _explained() -> dict:
    """{error type: (what the one line calls it, exit code)} of the errors megarl explains."""
    from megarl.checkpoint import CheckpointError
    from megarl.formats.hf_reader import ConversionError
    from megarl.ppo.nonfinite import NonFiniteError
    from megarl.rollout.engines.engine import EngineError, RequestError
    return {EngineError: ("engine error", 1),         # names the engine, its URL and log
            RequestError: ("request refused", 2),      # every sample of a step refused: the data or settings
            NonFiniteError: ("stopped", 1),            # names the quantity and the step
            CheckpointError: ("checkpoint not saved", 1),  # disk full: the previous one is intact
            ConfigError: ("config error", 2),
            ConversionError: ("model files", 2),       # an HF or megarl checkpoint folder the reader refuses
            FileNotFoundError: ("missing input", 2)}   # our messages name the setting


def _version() -> str:
    from megarl.doctor import megarl_version
    return megarl_version()


def _explain(err: Exception, what: str, code: int) -> int:
    """One line for an error megarl explains; MEGARL_DEBUG=1 re-raises it with its traceback."""
    if _debug():
        raise err
    print(f"megarl: {what}: {err}", file=sys.stderr)
    return code


def _plan(cfg, args) -> int:
    """Placement + memory per GPU (megarl/plan); a plan that does not fit exits 2 like any
    config error, naming what does not fit, by how much and what to change."""
    import json

    from megarl import plan
    from megarl.config.secrets import redacted_yaml
    if not cfg.cluster.gpus_per_node and args.gpus_per_node is None:
        print(redacted_yaml(cfg))
        return 0   # a CPU-only recipe: nothing to place (the resolved config, as before)
    if args.search:   # ranks splits with the simulator (megarl/sim/search.py)
        from megarl.sim import search
        try:
            print(search.format_search(search.search(cfg, seed=cfg.run.seed)))
        except ConfigError as err:
            return _explain(err, "config error", 2)
        return 0
    try:
        p = plan.make_plan(cfg, args.nodes, args.gpus_per_node, args.gpu_mem_gb)
    except ConfigError as err:
        return _explain(err, "config error", 2)
    if args.json:
        print(json.dumps(p, indent=1))
    elif args.config:   # still valid YAML: the resolved config, the plan as comments
        print(redacted_yaml(cfg) + "\n".join(
            "# " + line for line in plan.format_plan(p).splitlines()))
    else:
        print(plan.format_plan(p))
    if not p["fits"]:
        return _explain(ConfigError(plan.problems_message(p)), "plan does not fit", 2)
    return 0


def _simulate(cfg, args) -> int:
    import json

    from megarl.sim import recipe as sim
    try:
        costs = (sim.measured_costs(args.calibration, cfg) if args.calibration else
                 sim.roofline_costs(cfg, args.gpu, args.model, args.engine_tp or cfg.rollout.engines.tp,
                                    args.trainer_gpus or sim.trainer_gpus(cfg)))
        result = sim.run(cfg, args.lengths, costs, args.steps, cfg.run.seed)
    except ConfigError as err:
        return _explain(err, "config error", 2)
    print(json.dumps(result, indent=1) if args.json else sim.format_table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
