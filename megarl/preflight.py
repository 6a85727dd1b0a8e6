"""Inputs checked against the world before anything is written or started.

`load_config` checks a recipe against the schema; this module checks what the recipe points
at: the model folder's files (weights complete, a tokenizer that encodes), the dataset
against the engine's context (rollout.engines.max_model_len), and the engine layout against this
machine. Each check is cheap (headers and file sizes, one tokenizer pass over the prompts)
and raises ConfigError naming the setting or file, the value and the fix, so `megarl train`
exits 2 with one line before the run directory is touched.
"""
from __future__ import annotations

import glob
import json
import logging
import os
import struct

import psutil
import torch
from transformers import AutoConfig, AutoTokenizer

from megarl.checkpoint.manager import dist_folder_problem
from megarl.config.schema import ConfigError
from megarl.data.prompts import encode_prompts
from megarl.distributed.env import check_listen, read_env
from megarl.formats.hf_reader import ConversionError, HFCheckpoint
from megarl.formats.mapping import mapping_for
from megarl.models.builders import use_te
from megarl.models.loading import open_checked
from megarl.rollout.engines.gpus import own_gpus

log = logging.getLogger("megarl.data")

# files that hold a tokenizer's vocabulary (one of them must be in the model folder)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model", "*.tiktoken")


def safetensors_problem(path: str) -> str | None:
    """Why `path` is not a complete safetensors file (None when it is): its header must parse
    and the file must be as long as the header's tensors say. Reads only the header."""
    size = os.path.getsize(path)
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                return f"{size} bytes, shorter than a safetensors header"
            (n,) = struct.unpack("<Q", head)
            if n > size - 8:
                return f"{size} bytes, but its header alone says {n + 8}: truncated"
            header = json.loads(f.read(n))
    except (OSError, ValueError, UnicodeDecodeError) as err:
        return f"not a safetensors file ({err})"
    ends = [int(v["data_offsets"][1]) for k, v in header.items()
            if k != "__metadata__" and isinstance(v, dict) and "data_offsets" in v]
    want = 8 + n + max(ends, default=0)
    if size < want:
        return f"{size} bytes, but its tensors need {want}: truncated (an interrupted copy or download)"
    return None


def check_model_files(path: str, setting: str, tokenizer: bool = True) -> None:
    """The weights of an HF folder are complete, and (`tokenizer`) a tokenizer is there.
    `check_model_dir` (megarl/models/setup.py) has checked that the folder, config.json and
    *.safetensors exist."""
    for f in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
        problem = safetensors_problem(f)
        if problem:
            raise ConfigError(f"{setting}={path!r}: weights file {os.path.basename(f)} is damaged ({problem}): "
                              f"copy the model folder again from its source")
    # the index of a sharded checkpoint (and which file holds which tensor): the reader the
    # trainer loads through, opened on headers only
    try:
        HFCheckpoint(path).close()
    except (ConversionError, ValueError, KeyError, OSError) as err:
        raise ConfigError(f"{setting}={path!r}: {err}: copy the model folder again from its source") from None
    if tokenizer and not any(glob.glob(os.path.join(path, pattern)) for pattern in TOKENIZER_FILES):
        raise ConfigError(f"{setting}={path!r} has no tokenizer files (none of {', '.join(TOKENIZER_FILES)}): "
                          f"copy them (and tokenizer_config.json) from the model's source into the folder")


def check_weights_match(path: str, setting: str = "model.path") -> None:
    """config.json names an architecture megarl maps, and the safetensors hold each of its
    tensors with the shape config.json implies (headers only: what build_all checks again
    before loading, here before the run directory is touched)."""
    try:
        mapping = mapping_for(AutoConfig.from_pretrained(path, local_files_only=True), te_names=use_te())
        open_checked(path, mapping).close()
    except (ValueError, ConversionError) as err:
        raise ConfigError(f"{setting}={path!r}: {err}: config.json and the weights must describe one model "
                          f"of a supported architecture; copy the folder again from its source") from None


def read_hf_config(path: str, setting: str = "model.path") -> dict:
    """config.json of an HF folder as transformers reads it (a dict), or one line saying why not."""
    try:
        return AutoConfig.from_pretrained(path, local_files_only=True).to_dict()
    except Exception as err:   # noqa: BLE001 - bad JSON, an unknown model_type, ...
        first = str(err).splitlines()[0][:300] if str(err) else type(err).__name__
        raise ConfigError(f"{setting}={path!r}: its config.json does not load ({first}): fix the file, or "
                          f"copy it again from the model's source") from None


def load_tokenizer(path: str, setting: str = "model.path"):
    """The model folder's tokenizer, or one line saying why it does not load."""
    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)   # a folder: never the hub
    except Exception as err:   # noqa: BLE001 - transformers raises many types for a broken folder
        raise ConfigError(f"{setting}={path!r}: its tokenizer does not load ({type(err).__name__}: "
                          f"{str(err).splitlines()[0][:300] if str(err) else ''}): fix or copy again its "
                          f"tokenizer files") from None


def ensure_pad_token(tokenizer, path: str, setting: str = "model.path") -> None:
    """Give a tokenizer without a pad token (Llama's have none) its EOS as padding, as veRL
    and TRL do: megarl's batches are right-padded and the padding is masked out, so any id
    pads. Without an EOS either, there is nothing to pad or stop with: one line."""
    if tokenizer.pad_token_id is not None:
        return
    if tokenizer.eos_token_id is None:
        raise ConfigError(f"{setting}={path!r}: its tokenizer has neither a pad token nor an eos token: add "
                          f"\"pad_token\" and \"eos_token\" to its tokenizer_config.json")
    tokenizer.pad_token = tokenizer.eos_token


def check_prompts(records, tokenizer, cfg, vocab_size: int | None = None) -> None:
    """Raises ConfigError when the dataset cannot run on the engines (`prompts_problem`); drops
    from `records`, in place, the prompts too long for data.max_prompt_tokens or the engines'
    context (`drop_overlong`). `records` come from megarl.data.prompts.load_dataset (or
    load_prompts: their files and row numbers name a row)."""
    ids = encode_prompts(tokenizer, records, cfg.data, batch=True)
    problem = prompts_problem(records, ids, cfg, vocab_size)
    if problem:
        raise ConfigError(problem)
    drop_overlong(records, ids, cfg)


def _where(records, i: int, d) -> str:
    return records.where(i) if getattr(records, "files", None) else f"data.prompts={d.prompts!r}, row {i + 1}"


def prompts_problem(records, ids, cfg, vocab_size: int | None = None) -> str | None:
    """Why the dataset cannot run on the engines (None when it can): a prompt the tokenizer
    turns into no tokens (a tokenizer that does not belong to the model), or token ids outside
    the model's vocabulary. `ids`: each record's prompt ids (`encode_prompts`)."""
    empty = next((i for i, x in enumerate(ids) if not x), None)
    if empty is not None:
        return (f"{_where(records, empty, cfg.data)}: the tokenizer of model.path={cfg.model.path!r} encodes its "
                f"prompt {str(records[empty].get(cfg.data.prompt_key, ''))[:60]!r} to no tokens: the folder's "
                f"tokenizer files are missing or are not this model's; copy them from the model's source")
    if vocab_size:
        bad = next((i for i, x in enumerate(ids) if max(x) >= vocab_size), None)
        if bad is not None:
            return (f"{_where(records, bad, cfg.data)}: the tokenizer of model.path={cfg.model.path!r} gives token "
                    f"id {max(ids[bad])}, outside the model's vocab_size={vocab_size} (config.json): the "
                    f"tokenizer is not this model's")
    return None


def drop_overlong(records, ids, cfg) -> None:
    """The prompts longer than data.max_prompt_tokens (when set) or than the room the engines'
    context leaves for the response (rollout.engines.max_model_len - rollout.sampling.max_new_tokens,
    which the engine would refuse or cut short): data.overlong_prompts=drop takes them out of
    `records` (counted in records.dropped, the first few logged); =error, or every row too long,
    or a mixture's source left empty, stops the run in one line."""
    d, r = cfg.data, cfg.rollout
    room = r.engines.max_model_len - r.sampling.max_new_tokens
    limit = min(room, d.max_prompt_tokens) if d.max_prompt_tokens else room
    over = [i for i, x in enumerate(ids) if len(x) > limit]
    if not over:
        return
    longest = max(over, key=lambda i: len(ids[i]))
    n, where = len(ids[longest]), _where(records, longest, d)
    count = f"({len(over)} of {len(ids)} rows do)"
    if d.overlong_prompts == "error" or len(over) == len(ids):
        drop = "" if len(over) == len(ids) else ", or set data.overlong_prompts=drop to skip them"
        if n > room:
            raise ConfigError(f"{where}: a prompt of {n} tokens + rollout.sampling.max_new_tokens="
                              f"{r.sampling.max_new_tokens} exceeds rollout.engines.max_model_len="
                              f"{r.engines.max_model_len} {count}: raise rollout.engines.max_model_len to "
                              f"{n + r.sampling.max_new_tokens}, lower rollout.sampling.max_new_tokens to "
                              f"{max(r.engines.max_model_len - n, 0)}, or remove the long rows{drop}")
        raise ConfigError(f"{where}: a prompt of {n} tokens exceeds data.max_prompt_tokens={d.max_prompt_tokens} "
                          f"{count}: raise data.max_prompt_tokens to {n}, or remove the long rows{drop}")
    gone = set(over)
    if getattr(records, "weights", None):
        left = {records.sources[i] for i in range(len(records)) if i not in gone}
        empty = next((i for i in over if records.sources[i] not in left), None)
        if empty is not None:
            raise ConfigError(f"data.prompts: every prompt of the mixture's source holding {_where(records, empty, d)} "
                              f"is longer than {limit} tokens, so nothing is left to draw from it: raise "
                              f"data.max_prompt_tokens / rollout.engines.max_model_len, or remove that source")
    for i in over[:3]:
        log.warning("megarl: %s: prompt of %d tokens dropped (longer than %d: data.max_prompt_tokens / "
                    "rollout.engines.max_model_len - rollout.sampling.max_new_tokens)", _where(records, i, d),
                    len(ids[i]), limit)
    log.warning("megarl: %d of %d prompts dropped as longer than %d tokens (metric data_prompts_dropped; "
                "data.overlong_prompts=error stops instead)", len(over), len(ids), limit)
    records.keep([i for i in range(len(records)) if i not in gone])
    records.dropped = len(over)


def check_engines_fit(cfg, hf_config: dict) -> None:
    """rollout.engines.tp against the model and this machine, for engines megarl starts here
    (inprocess, local_servers); remote engines run where someone else started them."""
    r = cfg.rollout
    max_pos = hf_config.get("max_position_embeddings") or 0
    rope = hf_config.get("rope_scaling") or hf_config.get("rope_parameters") or {}
    if isinstance(rope, dict) and rope.get("rope_type", rope.get("type", "default")) not in ("default", None):
        max_pos = 0   # a scaled RoPE stretches the context: vLLM derives the limit, not checked here
    if r.engines.mode != "remote" and max_pos and r.engines.max_model_len > max_pos:
        raise ConfigError(f"rollout.engines.max_model_len={r.engines.max_model_len} exceeds the model's "
                          f"max_position_embeddings="
                          f"{max_pos} (model.path={cfg.model.path!r}/config.json), which vLLM refuses: use "
                          f"rollout.engines.max_model_len <= {max_pos}")
    if r.engines.mode == "remote":
        return
    if not torch.cuda.is_available():   # vLLM on CPU allocates rollout.engines.kv_cache_mb per engine up front
        total_mb = psutil.virtual_memory().total >> 20
        if r.engines.count * r.engines.kv_cache_mb > 0.8 * total_mb:
            raise ConfigError(f"rollout.engines.kv_cache_mb={r.engines.kv_cache_mb} x "
                              f"rollout.engines.count={r.engines.count} is more than 80% "
                              f"of this machine's {total_mb} MiB of memory (the engines' KV caches are allocated "
                              f"at start, next to the trainer): lower rollout.engines.kv_cache_mb or "
                              f"rollout.engines.count")
    if r.engines.tp == 1:
        return
    heads = hf_config.get("num_attention_heads") or 0
    if heads and heads % r.engines.tp:
        raise ConfigError(f"rollout.engines.tp={r.engines.tp} must divide the model's {heads} attention heads "
                          f"(vLLM splits heads over TP): pick a divisor of {heads}")
    if torch.cuda.is_available():
        gpus = torch.cuda.device_count()
        if r.engines.tp > gpus:
            raise ConfigError(f"rollout.engines.tp={r.engines.tp}: one engine needs that many GPUs and this machine "
                              f"shows {gpus}: use rollout.engines.tp <= {gpus}, or start the engines on larger "
                              f"nodes (rollout.engines.mode=remote)")
        return
    # on CPU, no NUMA node per TP worker is needed: megarl binds each worker of the engines it
    # starts to cores of its own (rollout/engines/build.py engine_env), where vLLM's `auto` binding
    # would ask for one NUMA node per worker; but one engine's workers need a core each
    cores = len(os.sched_getaffinity(0))
    if r.engines.tp > cores:
        raise ConfigError(f"rollout.engines.tp={r.engines.tp}: each TP worker of a CPU engine runs on cores of its "
                          f"own and this process may use {cores}: use rollout.engines.tp <= {cores} (more engines "
                          f"instead: rollout.engines.count)")


def check_backends(cfg) -> None:
    """The launch against this machine, before the ranks' process group is built (torch's own
    errors are tracebacks from inside it): more trainer ranks on this node than GPUs; the weight
    transfer's backend against the engines (weight_sync.backend=auto is ipc with a GPU and engines
    megarl starts, which needs rollout.engines.tp=1) and against weight_sync.lora=adapters (gloo
    only); NCCL, CUDA IPC or sequence parallelism asked
    for on a machine without a GPU; an address or port global rank 0 cannot host the weight
    group's rendezvous at."""
    check_weight_rendezvous(cfg)
    if torch.cuda.is_available():
        gpus, local_rank = torch.cuda.device_count(), read_env().local_rank
        if local_rank >= gpus:
            raise ConfigError(f"trainer rank with local rank {local_rank} has no GPU: this node shows {gpus}; "
                              f"launch at most {gpus} ranks per node (torchrun --nproc_per_node, srun "
                              f"--ntasks-per-node), or make more GPUs visible (CUDA_VISIBLE_DEVICES)")
        own = own_gpus(cfg.rollout.engines)   # the node's GPU split, refused here if it cannot be made
        ws = cfg.weight_sync
        if ws.transport == "collective":
            ws.check_engines(True, cfg.rollout.engines.mode, cfg.rollout.engines.tp, own)
            wire = ws.resolved_backend(True, cfg.rollout.engines.mode, own)
            if cfg.model.lora.rank and ws.lora == "adapters" and ws.adapters_refusal(wire):
                raise ConfigError(ws.adapters_refusal(wire))
        return
    for key, value in (("parallel.backend", cfg.parallel.backend), ("weight_sync.backend", cfg.weight_sync.backend)):
        if value in ("nccl", "ipc"):
            raise ConfigError(f"{key}={value!r} needs GPUs and this machine shows none: use {key}=auto "
                              f"(gloo without a GPU) or gloo")
    # parallel.sequence_parallel runs on CPU too (models/norms.py): nothing to refuse here


def check_weight_rendezvous(cfg) -> None:
    """Global rank 0 hosts the weight group's rendezvous at weight_sync.master_addr /
    master_port when they are set: an address that is not this machine's, or a port something
    else holds, would otherwise fail only at the first push, after the engines started."""
    ws = cfg.weight_sync
    if ws.transport != "collective" or not (ws.master_addr or ws.master_port) or read_env().rank != 0:
        return
    try:
        check_listen(ws.master_addr or "0.0.0.0", ws.master_port)
    except OSError as err:
        raise ConfigError(f"weight_sync.master_addr={ws.master_addr!r} / weight_sync.master_port={ws.master_port}: "
                          f"global rank 0 cannot listen there for the weight group ({err.strerror or err}): "
                          f"set weight_sync.master_addr to an address of this machine (or empty) and "
                          f"weight_sync.master_port to a free port (or 0: one is picked)") from None


def check_megatron_files(path: str, setting: str = "model.megatron_path") -> None:
    """A converted megatron checkpoint (`check_megatron_dir` has seen its metadata.json) has
    every shard file its .metadata points into, each long enough."""
    problem = dist_folder_problem(path)
    if problem:
        raise ConfigError(f"{setting}={path!r}: {problem}: convert it again with tools/convert_hf_to_megatron.py, "
                          f"or copy it again")


def check_episodes(cfg, records: list[dict], tokenizer) -> None:
    """env.name: the environment is made, resets on the first record and renders with this
    tokenizer (`envs.episodes.check_environment`); rollout.mode=service: the tokenizer has the
    chat template the agents' messages are rendered with."""
    if cfg.env.name:
        from megarl.envs.episodes import check_environment
        check_environment(cfg.env, records[0], tokenizer)
    if cfg.rollout.mode == "service" and not getattr(tokenizer, "chat_template", None):
        raise ConfigError(f"rollout.mode=service: the tokenizer of model.path={cfg.model.path} has no chat "
                          f"template, and agents send chat messages: use a chat model, or set a chat_template "
                          f"in its tokenizer_config.json")
