"""`megarl plan --search RECIPE`: the recipe's cluster split other ways, ranked by simulated
throughput (docs/plan.md, "Searching the split").

A small grid around the recipe: trainer nodes (the recipe's, one fewer, one more; the engines
get the rest of cluster.nodes), engine TP (the recipe's, half, twice; rollout.engines.count =
the engine GPUs / TP) and rollout.partial.concurrency (the recipe's, half, twice). Each
candidate is first planned (`megarl plan`'s memory check, the trainer re-laid out by
plan.best_layout where the recipe's TP x PP does not divide its GPUs); the ones that fit, and
the recipe's own split whatever it gives, are simulated in the recipe's rollout mode for a few
steps (the roofline costs of `megarl simulate`, the recipe's length distribution) and ranked by
trained tokens/s. Every function but `search` is pure arithmetic on the config.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from megarl.config import ConfigError
from megarl.models.arch import resolve_arch
from megarl.plan import make_plan
from megarl.plan.inputs import reward_arch
from megarl.plan.placement import FUSED
from megarl.plan.trainer import best_layout, with_layout
from megarl.sim import recipe as sim
from megarl.sim.workload import parse_dist

SEARCH_STEPS = 2   # a shortened simulation: the first round fresh, the second with its carry


@dataclass(frozen=True)
class Split:
    trainer_nodes: int
    engine_nodes: int
    engine_tp: int
    engines: int
    concurrency: int


def recipe_split(cfg) -> Split:
    c, e = cfg.cluster, cfg.rollout.engines
    return Split(c.trainer_node_count, c.engine_nodes, e.tp, e.count, cfg.rollout.partial.concurrency)


def splits(cfg, heads: int, kv_heads: int) -> list[Split]:
    """The grid around the recipe's split (it first), each engine TP one vLLM allows (dividing
    the heads, dividing or a multiple of the KV heads, within a node)."""
    c, own = cfg.cluster, recipe_split(cfg)
    g = c.gpus_per_node
    if not c.engine_nodes or not g:
        raise ConfigError("megarl plan --search: the recipe has no engine nodes (cluster.engine_nodes=0) to split "
                          "against the trainer's; give cluster.engine_nodes and cluster.gpus_per_node")
    out = [own]
    for t in (own.trainer_nodes, own.trainer_nodes - 1, own.trainer_nodes + 1):
        e_nodes = c.nodes - t
        if t < 1 or e_nodes < 1:
            continue
        for tp in (own.engine_tp, own.engine_tp // 2, own.engine_tp * 2):
            if tp < 1 or tp > g or heads % tp or (kv_heads % tp and tp % kv_heads):
                continue
            for conc in (own.concurrency, own.concurrency // 2, own.concurrency * 2):
                s = Split(t, e_nodes, tp, e_nodes * g // tp, conc)
                if conc >= 1 and s not in out:
                    out.append(s)
    return out


def with_split(cfg, s: Split):
    """The recipe on split `s` (the trainer's TP x PP unchanged)."""
    r = cfg.rollout
    return replace(cfg, cluster=replace(cfg.cluster, trainer_nodes=s.trainer_nodes, engine_nodes=s.engine_nodes),
                   rollout=replace(r, engines=replace(r.engines, tp=s.engine_tp, count=s.engines),
                                   partial=replace(r.partial, concurrency=s.concurrency)))


def planned(cfg, s: Split) -> tuple[object, dict | None, str]:
    """(the config of split `s`, its plan or None, why it does not fit: "" when it does). The
    trainer takes plan.best_layout's TP x PP where the recipe's does not divide its GPUs."""
    c = with_split(cfg, s)
    arch, _ = resolve_arch(c)
    gpus = s.trainer_nodes * c.cluster.gpus_per_node
    p = c.parallel
    if gpus % (p.tp * p.pp):
        best = best_layout(c, arch, gpus, c.cluster.gpus_per_node, FUSED, reward_arch(c, arch)[0])
        if best is None:
            return c, None, f"no trainer layout of {gpus} GPUs"
        c = with_layout(c, best[0])
    try:
        plan = make_plan(c)
    except ConfigError as err:
        return c, None, str(err)
    if not plan["fits"]:
        return c, plan, "; ".join(x["role"] + ": " + x["what"] for x in plan["problems"])
    return c, plan, ""


def simulate_split(cfg, lengths: str, gpu: str, steps: int, seed: int) -> dict:
    """The recipe's rollout mode on `cfg`'s split, `steps` steps: its figures (recipe._figures)."""
    r = cfg.rollout
    mode = "sync" if r.mode == "sync" else ("async" if r.partial.asynchronous else "partial")
    costs = sim.roofline_costs(cfg, gpu, "", r.engines.tp, sim.trainer_gpus(cfg))
    dist = parse_dist(lengths or sim.default_lengths(cfg))
    return sim.simulate_mode(cfg, dist, mode, costs, steps, seed) | {"mode": mode,
                                                                      "paused_s": costs[0].load_weights_s}


def search(cfg, lengths: str = "", gpu: str = "h100", steps: int = SEARCH_STEPS, seed: int = 0) -> dict:
    """Every split of the grid planned; those that fit and the recipe's own simulated; rows
    sorted by trained tokens/s (those not simulated last)."""
    arch, _ = resolve_arch(cfg)
    own = recipe_split(cfg)
    rows = []
    for s in splits(cfg, arch.heads, arch.kv_heads):
        c, plan, why = planned(cfg, s)
        row = {"split": s, "recipe": s == own, "fits": not why, "why": why,
               "trainer": f"TP={c.parallel.tp} PP={c.parallel.pp}",
               "staging_fits": bool(plan and plan["engine"] and plan["engine"]["staging_fits"])}
        if not why or s == own:
            f = simulate_split(c, lengths, gpu, steps, seed)
            row.update(tokens_per_s=f["trained_tokens_per_s"], unit_s=f["unit_s"], mode=f["mode"],
                       paused_s=f["paused_s"])
        rows.append(row)
    return {"rows": rank(rows), "steps": steps, "gpu": gpu, "staged": cfg.weight_sync.staged}


def rank(rows: list[dict]) -> list[dict]:
    """Simulated rows by trained tokens/s, highest first; the rest after them, in grid order."""
    done = [r for r in rows if "tokens_per_s" in r]
    return sorted(done, key=lambda r: -r["tokens_per_s"]) + [r for r in rows if "tokens_per_s" not in r]


def format_search(result: dict, top: int = 5) -> str:
    """The best `top` simulated splits, and the recipe's own (marked *) wherever it ranks."""
    rows = [r for r in result["rows"] if "tokens_per_s" in r]
    shown = rows[:top] + [r for r in rows[top:] if r["recipe"]]
    skipped = len(result["rows"]) - len(rows)
    lines = [f"splits ranked by simulated trained tokens/s ({result['steps']} steps of the recipe's rollout mode, "
             f"roofline {result['gpu']}; memory checked by megarl plan):",
             "rank  trainer nodes  engine nodes  engines x TP  concurrency  trainer        step s  trained tok/s  "
             "paused s  fits  staged copy fits"]
    for r in shown:
        s = r["split"]
        mark = "*" if r["recipe"] else " "
        lines.append(f"{rows.index(r) + 1:4d}{mark} {s.trainer_nodes:13d}  {s.engine_nodes:12d}  "
                     f"{f'{s.engines} x {s.engine_tp}':>12s}  {s.concurrency:11d}  {r['trainer']:13s}  "
                     f"{r['unit_s']:6.2f}  {r['tokens_per_s']:13.0f}  {r['paused_s']:8.2f}  "
                     f"{'yes' if r['fits'] else 'NO':>4s}  {'yes' if r['staging_fits'] else 'no':>16s}")
    lines.append(f"(* the recipe's split; step s per train.groups_per_step groups; {skipped} of "
                 f"{len(result['rows'])} splits do not fit and were not simulated; staged copy: whether "
                 f"weight_sync.staged's staging area fits beside the engine's weights, docs/plan.md)")
    own = next(r for r in result["rows"] if r["recipe"])
    if not own["fits"]:
        lines.append(f"the recipe's split does not fit: {own['why']}")
    return "\n".join(lines)
