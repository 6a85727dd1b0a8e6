"""The numbers a cluster recipe's comments state are the ones `megarl plan` and the config give:
nodes and GPUs, the trainer's TP x PP x DP and layers per stage, engines, engine TP and
requests per engine, sequence lengths, micro-batch budget, sequences per step / update / DP rank,
heads. A statement a recipe makes in these words is checked; a number in a recipe comment that
no check reads is refused (state it in these words, or leave it to `megarl plan`)."""
import re
from pathlib import Path

import pytest

from megarl.config import load_config
from megarl.plan import make_plan

ROOT = Path(__file__).resolve().parents[2]
RECIPES = [p for p in sorted((ROOT / "recipes").glob("*.yaml"))
           if p.name != "base.yaml" and load_config(p).cluster.gpus_per_node]


def facts(cfg, plan) -> list[tuple[str, list]]:
    """(pattern, the values its numbers must have) for each statement a recipe comment may make."""
    c, tr, en, m = cfg.cluster, plan["placement"]["trainer"], plan["placement"]["engines"], plan["model"]
    seq, new = cfg.rollout.engines.max_model_len, cfg.rollout.sampling.max_new_tokens
    per_update = cfg.samples_per_step // cfg.train.mini_batches
    experts = [(r"EP=(\d+)", [cfg.parallel.ep]),
               (r"(\d+) of the (\d+) experts", [m["experts"] // cfg.parallel.ep, m["experts"]]),
               (r"(\d+) experts, (\d+) per token", [m["experts"], m["top_k"]]),
               (r"EDP = \d+ / \d+ = (\d+)", [tr.get("edp")]),
               (r"in each of the (\d+) layers", [m["layers"]]),
               (r"over the (\d+) DP ranks\)", [tr["dp"]]),
               (r"spread over all (\d+)\s+#?\s*GPUs", [tr["gpus"]]),
               (r"on (\d+) trainer GPUs", [tr["gpus"] // 2]),
               (r"expert TP=(\d+)", [tr.get("etp")]),
               (r"(\d+) experts per EP rank, each split over (\d+) GPUs", [m["experts"] // cfg.parallel.ep,
                                                                          tr.get("etp")]),
               (r"the rest's over the (\d+) DP ranks", [tr["dp"]])] if m["experts"] else []
    return [
        (r"Sized for: (\d+) nodes x (\d+) GPUs \S+ \((\d+) GPUs, (\d+) GiB each\)",
         [c.nodes, c.gpus_per_node, c.nodes * c.gpus_per_node, int(c.gpu_mem_gb)]),
        (r"trainer: (\d+) nodes? = (\d+) GPUs, TP=(\d+)", [tr["nodes"], tr["gpus"], tr["tp"]]),
        (r"micro batch (\d+)", [cfg.train.max_tokens_per_micro_batch // seq]),
        (r"PP=(\d+)(?: \((\d+) layers per stage\))? x DP=(\d+)",
         [tr["pp"], m["layers"] // tr["pp"], tr["dp"]]),
        (r"sharded over the (\d+) DP ranks", [tr["dp"]]),
        (r"engines: (\d+) nodes? = (\d+) GPUs, (\d+) vLLM engines x engine TP=(\d+), concurrency (\d+) "
         r"\((\d+) per engine\)", [en["nodes"], en["gpus"], en["count"], en["tp"],
                                   cfg.rollout.partial.concurrency, plan["engine"]["requests_per_engine"]]),
        (r"prompt <= (\d+) \+ response <= (\d+) = (\d+) tokens", [seq - new, new, seq]),
        (r"micro-batches of up to (\d+)", [cfg.train.max_tokens_per_micro_batch]),
        (r"= (\d+) sequences per step", [cfg.samples_per_step]),
        (r"(\d+) sequences per optimizer update(?:, (\d+) per DP rank)?", [per_update, per_update // tr["dp"]]),
        (r"up to (\d+) tokens each", [cfg.train.max_tokens_per_micro_batch]),
        (r"one (\d+)-token row", [seq]),
        (r"two (\d+)-token rows", [seq]),
        (r"has (\d+) KV heads: trainer TP <= (\d+); (\d+) heads", [m["kv_heads"], m["kv_heads"], m["heads"]]),
        (r"(\d+) samples per prompt", [cfg.rollout.sampling.n]),
        (r"warm-up over (\d+) steps = (\d+) optimizer updates",
         [cfg.train.lr_warmup_steps, cfg.train.lr_warmup_steps * cfg.train.ppo_epochs * cfg.train.mini_batches]),
        (r"(\d+) layers: PP must divide them", [m["layers"]]),
        (r"(\d+) trainer GPUs where the full fine-tune needs (\d+)", [tr["gpus"], full_fine_tune_gpus(cfg)]),
        *experts,
    ]


def full_fine_tune_gpus(cfg) -> int | None:
    """A LoRA recipe's counterpart: the trainer GPUs of the cluster recipe that fine-tunes the same
    model in full (same model.path, model.lora.rank=0); None without LoRA or counterpart."""
    if not cfg.model.lora.rank:
        return None
    for path in RECIPES:
        other = load_config(path)
        if other.model.path == cfg.model.path and not other.model.lora.rank:
            return make_plan(other)["placement"]["trainer"]["gpus"]
    return None


def comments(text: str) -> str:
    """A recipe's comments as one line of text (the words of a statement may cross lines)."""
    return " ".join(line.split("#", 1)[1].strip() for line in text.splitlines() if "#" in line)


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
def test_recipe_comment_numbers_are_the_plans(recipe):
    cfg = load_config(recipe)
    plan = make_plan(cfg)
    rest = said = comments(recipe.read_text())
    for pattern, want in facts(cfg, plan):
        for mo in re.finditer(pattern, said):
            got = [int(g) if g is not None else None for g in mo.groups()]
            assert all(g is None or g == w for g, w in zip(got, want)), (recipe.name, mo.group(), want)
            rest = rest.replace(mo.group(), " ")
    # every other number of a comment is in a `megarl plan ...` command, a key=value or a name
    rest = re.sub(r"`[^`]*`", " ", rest)
    rest = re.sub(r"[\w.]+=\S+", " ", rest)
    rest = re.sub(r"\b(Qwen|Llama|H100|H200|A100)[\w.\-]*", " ", rest)
    unchecked = re.findall(r"(?<![\w.\-])\d+(?:\.\d+)?(?![\w.])", rest)
    assert not unchecked, (recipe.name, unchecked, rest)
