"""Every command in the README's code blocks and docs/cluster.md's is checked: `megarl plan`
really runs; `megarl train / check / simulate` (and through torchrun or srun) load their
recipe and overrides as the command would and validate the launched world; `sbatch` computes
the job's layout as slurm/common.sh does, with the command's environment (the stand-in's PATH
included); `make` targets, scripts and their --options, copied files and pip extras exist. A
command of a kind this test does not know fails it, so a new one in the docs gets a check.
(The expensive ones run elsewhere: `make demo` is the demo, the stand-in job tests/e2e/test_slurm.py.)"""
from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from megarl.config import load_config, validate_world
from megarl.plan.job import job_layout

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", ROOT / "docs" / "cluster.md"]
# the docs' placeholders for the user's own recipe: the quickstart copies the 7B one
PLACEHOLDERS = {"recipes/my.yaml": "recipes/qwen2.5_7b.yaml", "recipes/x.yaml": "recipes/tiny_cpu.yaml",
                "recipes/my_agent.yaml": "recipes/tiny_agent_cpu.yaml", "RECIPE": "recipes/qwen2.5_7b.yaml"}
USERS_CODE = ("path/to/", "my_package")   # a value naming the user's own code: only its key is checked
OUTPUT_LINES = ("megarl: ", "step ")   # blocks showing what a command prints, not commands


def commands(doc: Path) -> list[str]:
    """The shell commands of `doc`'s code blocks: continuation lines joined, comments dropped."""
    out, block, joined = [], False, ""
    for line in doc.read_text().splitlines():
        if line.startswith("```"):
            block = not block
            continue
        if not block:
            continue
        line = re.sub(r"\s+#.*$", "", line).rstrip()
        if joined:
            line, joined = joined + " " + line.strip(), ""
        if line.endswith("\\"):
            joined = line[:-1].rstrip()
            continue
        if line.strip() and not line.lstrip().startswith("#") and not line.startswith(OUTPUT_LINES):
            out += [part.strip() for part in line.split(" && ")]
    return out


CASES = [(doc.relative_to(ROOT).as_posix(), c) for doc in DOCS for c in commands(doc)]


def test_the_docs_have_commands():
    assert len([c for d, c in CASES if d == "README.md"]) > 30
    assert any(c.split()[0].startswith("PATH=") for d, c in CASES if d == "docs/cluster.md")


def _split_env(words: list[str]) -> tuple[dict, list[str]]:
    env = {}
    while words and re.match(r"^[A-Z_][A-Z0-9_]*=", words[0]):
        k, v = words.pop(0).split("=", 1)
        env[k] = v
    return env, words


def _recipe(word: str) -> str:
    return PLACEHOLDERS.get(word, word)


def _key_exists(cfg, override: str) -> None:
    obj = cfg
    for part in override.split("=", 1)[0].split("."):
        assert hasattr(obj, part), override
        obj = getattr(obj, part)


def _megarl(args: list[str], world: int = 0) -> None:
    """world: the ranks launched (0: the recipe's trainer GPUs, or one process on a CPU recipe)."""
    sub, rest = args[0], args[1:]
    if sub == "doctor":
        return          # tests/unit/test_cli_doctor_check.py runs it
    if sub == "export":   # a run folder's checkpoint (tests/unit/test_export_cli.py runs it)
        assert rest[0].startswith("runs/") and "--out" in rest, rest
        return
    options = {}
    positional = []
    it = iter(rest)
    for a in it:
        if a.startswith("--"):
            options[a] = next(it)
        else:
            positional.append(a)
    recipe = _recipe(positional[0])
    users = [o for o in positional[1:] if any(u in o.split("=", 1)[-1] for u in USERS_CODE)]
    overrides = [o for o in positional[1:] if o not in users]
    assert (ROOT / recipe).is_file(), recipe
    if sub == "plan":   # cheap: really run it
        from megarl.cli import main
        assert main(["plan", recipe, *overrides]) == 0
        return
    if sub == "eval":   # an exported HF folder or a run's checkpoint (tests/unit/test_eval_cli.py runs it)
        assert ("--model" in options) != ("--run" in options) and "--out" in options, options
        load_config(ROOT / recipe, overrides)
        return
    assert sub in ("train", "check", "simulate"), sub
    cfg = load_config(ROOT / recipe, overrides)
    for o in users:
        _key_exists(cfg, o)
    c = cfg.cluster
    validate_world(cfg, world or (c.trainer_node_count * c.gpus_per_node if c.gpus_per_node else 1))
    if "--model" in options:
        assert (ROOT / "recipes" / "models" / f"{options['--model'].replace('-', '_')}.yaml").is_file()


def _python(args: list[str], made: set[str]) -> None:
    if args[0] == "-m":
        assert args[1] == "venv", args
        return
    script = ROOT / args[0]
    assert script.is_file(), args[0]
    text = script.read_text()
    # the script's options, or those of the megarl module it hands its command line to
    for module in re.findall(r"^from (megarl[\w.]*) import", text, re.M):
        path = ROOT / module.replace(".", "/")
        text += (path / "__init__.py" if path.is_dir() else path.with_suffix(".py")).read_text()
    for flag in (a.split("=")[0] for a in args[1:] if a.startswith("--")):
        assert f'"{flag}"' in text, (args[0], flag)
    if "--out" in args:
        made.add(args[args.index("--out") + 1])


def _sbatch(env: dict, args: list[str]) -> None:
    if "PATH" in env:   # the stand-in: its bin/ first on PATH
        first = env["PATH"].split(":")[0].replace("$PWD", str(ROOT))
        assert (Path(first) / "sbatch").is_file(), first
    nodes = [int(a.split("=")[1]) for a in args if a.startswith("--nodes=")]
    script = ROOT / args[-1]
    text = script.read_text()
    recipe = env.get("RECIPE") or re.search(r"RECIPE=\$\{RECIPE:-(\S+)\}", text).group(1)
    recipe = _recipe(recipe)
    cfg = load_config(ROOT / recipe, shlex.split(env.get("EXTRA", "")))
    layout = job_layout(cfg, {k: v for k, v in env.items() if k != "PATH"})
    sbatch_nodes = nodes[0] if nodes else int(re.search(r"^#SBATCH --nodes=(\d+)$", text, re.M).group(1))
    assert sbatch_nodes >= layout.nodes, (sbatch_nodes, layout)


@pytest.mark.parametrize("doc,command", CASES, ids=[f"{d}:{c[:60]}" for d, c in CASES])
def test_doc_command(doc, command):
    made: set[str] = set()
    for earlier in (c for d, c in CASES if d == doc):   # files an earlier command of the doc writes
        if earlier == command:
            break
        words = shlex.split(earlier)
        if words[0] == "python" and "--out" in words:
            made.add(words[words.index("--out") + 1])
    env, words = _split_env(shlex.split(command))
    head = words[0]
    if head in ("megarl", ".venv/bin/megarl"):
        if "--calibration" in words:
            path = words[words.index("--calibration") + 1]
            assert path in made or (ROOT / path).is_file(), path
        _megarl(words[1:])
    elif head == "torchrun":
        nproc = int(words[words.index("--nproc_per_node") + 1])
        at = words.index("megarl.cli")
        _megarl(words[at + 1:], world=nproc)
    elif head == "srun":
        at = next(i for i, w in enumerate(words) if w.endswith("megarl"))
        _megarl(words[at + 1:])
    elif head in ("python", "python3.12"):
        _python(words[1:], made)
    elif head == "make":
        targets = re.findall(r"^([a-z][a-z-]*):", (ROOT / "Makefile").read_text(), re.M)
        assert words[1] in targets, words
    elif head == "sbatch":
        _sbatch(env, words[1:])
    elif head == "bash":
        assert (ROOT / words[1]).is_file(), words
    elif head == "cp":
        assert (ROOT / words[1]).is_file(), words
    elif head == "tail":
        assert words[2].startswith(("runs/", "RUN_DIR/")), words   # a run's output: nothing to check
    elif head in ("pip", ".venv/bin/pip") or head.endswith("/pip"):
        extras = re.search(r"\[(\w+)\]", command).group(1)
        assert f'"{extras}"' in (ROOT / "setup.py").read_text(), extras
    else:
        raise AssertionError(f"{doc}: a command this test does not know how to check: {command}")
