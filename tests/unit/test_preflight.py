"""Inputs checked against the world before a run starts (megarl/preflight.py): model
files, the tokenizer, the dataset against the engine's context, engine TP against the machine."""
import shutil

import pytest

from megarl import preflight
from megarl.config import ConfigError, load_config
from megarl.data.prompts import load_prompts
from megarl.formats.hf_reader import ConversionError, HFCheckpoint


@pytest.fixture()
def model_copy(tiny_model, tmp_path):
    dst = tmp_path / "model"
    shutil.copytree(tiny_model, dst)
    return dst


def test_a_truncated_weights_file_is_named(model_copy):
    f = model_copy / "model.safetensors"
    assert preflight.safetensors_problem(str(f)) is None
    preflight.check_model_files(str(model_copy), "model.path")
    full = f.stat().st_size
    with open(f, "r+b") as fh:
        fh.truncate(full - 1)
    assert "truncated" in preflight.safetensors_problem(str(f))
    with pytest.raises(ConfigError, match=r"model\.path=.*weights file model\.safetensors is damaged.*truncated"):
        preflight.check_model_files(str(model_copy), "model.path")
    with open(f, "r+b") as fh:       # cut inside the header
        fh.truncate(100)
    assert "header alone" in preflight.safetensors_problem(str(f))
    f.write_bytes(b"\x05\x00")
    assert "shorter than a safetensors header" in preflight.safetensors_problem(str(f))
    f.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!")
    assert "not a safetensors file" in preflight.safetensors_problem(str(f))


def test_a_model_folder_without_tokenizer_files_is_refused(model_copy):
    for name in ("tokenizer.json", "tokenizer_config.json", "tokenization_countdown.py"):
        (model_copy / name).unlink()
    with pytest.raises(ConfigError, match=r"model\.path=.* has no tokenizer files"):
        preflight.check_model_files(str(model_copy), "model.path")
    preflight.check_model_files(str(model_copy), "reward.model_path", tokenizer=False)   # a reward model needs none


class EmptyVocab:
    """What transformers builds for a folder without tokenizer files (from config.json alone): a
    tokenizer with an empty vocabulary that turns every prompt into [] (the round then hung on
    empty prompts). A stand-in: loading the real one waits on the network for the missing files."""

    def __call__(self, texts, add_special_tokens=False):
        return {"input_ids": [[] for _ in texts]}


def test_a_tokenizer_that_encodes_prompts_to_nothing_is_named_with_the_row(model_copy, tmp_path):
    tok = EmptyVocab()
    data = tmp_path / "p.jsonl"
    data.write_text('{"prompt": "<bos> n3 ="}\n')
    cfg = load_config("recipes/tiny_cpu.yaml", [f"model.path={model_copy}", f"data.prompts={data}"])
    with pytest.raises(ConfigError, match=r"row 1: the tokenizer of model\.path=.* encodes its prompt .* to no tokens"):
        preflight.check_prompts(load_prompts(str(data)), tok, cfg)


def test_broken_config_json_and_tokenizer_are_one_line(model_copy):
    (model_copy / "tokenizer.json").write_text("{")
    with pytest.raises(ConfigError, match=r"model\.path=.*: its tokenizer does not load"):
        preflight.load_tokenizer(str(model_copy))
    (model_copy / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match=r"model\.path=.*: its config\.json does not load"):
        preflight.read_hf_config(str(model_copy))


def test_prompts_that_leave_no_room_for_the_response_name_row_and_limits(tiny_model, tmp_path):
    data = tmp_path / "p.jsonl"
    long = "<bos> " + " ".join(["n3"] * 230) + " ="
    data.write_text('{"prompt": "<bos> n3 ="}\n\n{"prompt": "%s"}\n{"prompt": "<bos> n4 ="}\n' % long)
    records = load_prompts(str(data))
    assert records.rows == [1, 3, 4]    # JSONL line numbers, blank lines skipped
    tok = preflight.load_tokenizer(str(tiny_model))
    cfg = load_config("recipes/tiny_cpu.yaml", [f"data.prompts={data}", "data.overlong_prompts=error"])
    with pytest.raises(ConfigError, match=r"row 3: a prompt of 232 tokens \+ rollout\.sampling\.max_new_tokens=56 "
                                          r"exceeds rollout\.engines\.max_model_len=256 \(1 of 3 rows do\): raise "
                                          r"rollout\.engines\.max_model_len to 288, lower "
                                          r"rollout\.sampling\.max_new_tokens to 24"):
        preflight.check_prompts(records, tok, cfg)
    short = load_prompts(str(tiny_model / "prompts.jsonl"))
    preflight.check_prompts(short, tok, cfg, vocab_size=128)
    # the budget alone: 3-token prompts + 254 new tokens > 256 (every row: nothing left to drop)
    budget = load_config("recipes/tiny_cpu.yaml", ["rollout.sampling.max_new_tokens=254"])
    with pytest.raises(ConfigError, match=r"rollout\.sampling\.max_new_tokens=254 exceeds "
                                          r"rollout\.engines\.max_model_len=256"):
        preflight.check_prompts(short, tok, budget)
    with pytest.raises(ConfigError, match=r"outside the model's vocab_size=5"):
        preflight.check_prompts(short, tok, cfg, vocab_size=5)


def test_engine_tp_against_the_model_and_the_machine(monkeypatch):
    arch = {"num_attention_heads": 4, "max_position_embeddings": 256}

    def cfg(*o):
        return load_config("recipes/tiny_cpu.yaml", list(o))
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.delenv("VLLM_CPU_SIM_MULTI_NUMA", raising=False)
    preflight.check_engines_fit(cfg(), arch)
    # megarl binds each TP worker of its engines to cores of its own (build.engine_env): no NUMA
    # node per worker needed, as vLLM's `auto` binding would ask
    monkeypatch.setattr(preflight.os, "sched_getaffinity", lambda pid: {0, 1})
    preflight.check_engines_fit(cfg("rollout.engines.tp=2"), arch)
    with pytest.raises(ConfigError, match=r"rollout\.engines\.tp=4: each TP worker of a CPU engine runs on cores "
                                          r"of its own and this process may use 2: use rollout\.engines\.tp <= 2"):
        preflight.check_engines_fit(cfg("rollout.engines.tp=4"), arch)
    with pytest.raises(ConfigError, match=r"rollout\.engines\.tp=3 must divide the model's 4 attention heads"):
        preflight.check_engines_fit(cfg("rollout.engines.tp=3"), arch)
    # remote engines run elsewhere; threads bound by hand need no NUMA node each
    preflight.check_engines_fit(cfg("rollout.engines.tp=2", "rollout.engines.mode=remote",
                                    "rollout.engines.urls=[http://n:1]"), arch)
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    preflight.check_engines_fit(cfg("rollout.engines.tp=2"), arch)
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    monkeypatch.setattr("torch.cuda.device_count", lambda: 1)
    with pytest.raises(ConfigError, match=r"rollout\.engines\.tp=2: one engine needs that many GPUs and this "
                                          r"machine shows 1"):
        preflight.check_engines_fit(cfg("rollout.engines.tp=2"), arch)
    with pytest.raises(ConfigError, match=r"rollout\.engines\.max_model_len=512 exceeds the model's "
                                          r"max_position_embeddings=256"):
        preflight.check_engines_fit(cfg("rollout.engines.max_model_len=512"), arch)
    scaled = {**arch, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}
    preflight.check_engines_fit(cfg("rollout.engines.max_model_len=512"), scaled)   # vLLM's to judge


def test_a_data_file_that_is_not_text(tmp_path):
    data = tmp_path / "p.jsonl"
    data.write_bytes(b"\xff\xfe\x00binary\n")
    with pytest.raises(ConfigError, match=r"data\.prompts=.*: not a text file"):
        load_prompts(str(data))


class Special:
    """A tokenizer's special tokens only (what ensure_pad_token reads and sets)."""

    def __init__(self, pad, eos):
        self.pad_token, self.eos_token = pad, eos

    @property
    def pad_token_id(self):
        return None if self.pad_token is None else 0

    @property
    def eos_token_id(self):
        return None if self.eos_token is None else 2


def test_a_tokenizer_without_pad_token_pads_with_eos():
    llama = Special(None, "<|eot_id|>")   # Llama's tokenizers have no pad token: batches padded with None crashed
    preflight.ensure_pad_token(llama, "m")
    assert llama.pad_token == "<|eot_id|>"
    has = Special("<pad>", "<eos>")
    preflight.ensure_pad_token(has, "m")
    assert has.pad_token == "<pad>"
    with pytest.raises(ConfigError, match=r"model\.path='m': its tokenizer has neither a pad token nor an eos token"):
        preflight.ensure_pad_token(Special(None, None), "m")


def test_the_launch_against_the_machine(monkeypatch):
    cfg = load_config("recipes/tiny_cpu.yaml", ["parallel.backend=nccl"])
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    with pytest.raises(ConfigError, match=r"parallel\.backend='nccl' needs GPUs and this machine shows none"):
        preflight.check_backends(cfg)
    preflight.check_backends(load_config("recipes/tiny_cpu.yaml", []))
    # sequence parallelism runs without a GPU (megatron's MoE layers need it at TP > 1)
    preflight.check_backends(load_config("recipes/tiny_cpu.yaml", ["parallel.tp=2", "parallel.sequence_parallel=true"]))
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    monkeypatch.setattr("torch.cuda.device_count", lambda: 2)
    for var, value in {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "3"}.items():
        monkeypatch.setenv(var, value)
    with pytest.raises(ConfigError, match=r"local rank 3 has no GPU: this node shows 2; launch at most 2 ranks "
                                          r"per node"):
        preflight.check_backends(cfg)
    monkeypatch.setenv("LOCAL_RANK", "1")
    preflight.check_backends(cfg)


def test_the_hf_reader_names_a_damaged_weights_file(model_copy):
    """The converters (tools/convert_hf_to_megatron.py) read through HFCheckpoint too: a cut
    file is a ConversionError naming it (they print it, exit 2), not safetensors' own error."""
    with open(model_copy / "model.safetensors", "r+b") as f:
        f.truncate(100_000)
    with pytest.raises(ConversionError, match=r"model\.safetensors in .* is not a readable safetensors file"):
        HFCheckpoint(model_copy)


# -- episodes (env.*, rollout.mode=service): a mistake that would fail every episode stops the run
@pytest.fixture(scope="module")
def tokenizers():
    from megarl.data import countdown, guess
    return {"guess": guess.build_tokenizer(), "countdown": countdown.build_tokenizer()}


def _guess_records():
    from megarl.data import guess
    return guess.make_records(4, seed=0)


def _episodes(overrides):
    return load_config("recipes/tiny_agent_cpu.yaml", overrides)


def test_the_agent_recipe_passes_the_episode_checks(tokenizers):
    preflight.check_episodes(_episodes([]), _guess_records(), tokenizers["guess"])


@pytest.mark.parametrize("overrides, data, tok, match", [
    # the environment's records are not in data.prompts (countdown rows have no secret)
    ([], "countdown", "guess", r"env\.name=guess: reset\(the first record of data\.prompts\) failed "
                              r"\(ValueError: guess record field 'secret'=None.*does data\.prompts hold"),
    (["env.options={k: 3}"], "guess", "guess", r"env\.options=\{'k': 3\}: env\.name=guess cannot be made"),
    (["env.template=chat"], "guess", "countdown", r"env\.template=chat: the model's tokenizer has no chat template"),
    (["env.name=''", "env.timeout_s=10", "rollout.mode=service"], "guess", "countdown",
     r"rollout\.mode=service: the tokenizer of model\.path=.* has no chat template"),
])
def test_episode_inputs_that_would_fail_every_episode_are_refused(tokenizers, overrides, data, tok, match):
    from megarl.data import countdown
    records = _guess_records() if data == "guess" else countdown.make_records(4, seed=0)
    with pytest.raises(ConfigError, match=match):
        preflight.check_episodes(_episodes(overrides), records, tokenizers[tok])


def test_an_environment_that_hangs_in_reset_is_named_with_env_timeout_s(tokenizers):
    import asyncio

    from megarl.envs.base import Environment, register_env

    @register_env("test_hangs_in_reset")
    class Hangs(Environment):
        async def reset(self, record):
            await asyncio.sleep(60)

        async def step(self, turn):
            raise AssertionError("never reached")
    try:
        cfg = _episodes(["env.name=test_hangs_in_reset", "env.timeout_s=0.5"])
        with pytest.raises(ConfigError, match=r"env\.timeout_s=0\.5: env\.name=test_hangs_in_reset did not reset"):
            preflight.check_episodes(cfg, _guess_records(), tokenizers["guess"])
    finally:   # registered for this test only
        from megarl.config.registry import ENVIRONMENTS
        ENVIRONMENTS._entries.pop("test_hangs_in_reset", None)


def test_a_weight_rendezvous_rank_0_cannot_host_is_refused_before_anything_starts(monkeypatch):
    """weight_sync.master_addr not of this machine, or weight_sync.master_port held by another
    process: refused at launch with both settings named, not at the first push after the
    engines started; a free port and this machine's address pass; other ranks do not check."""
    import socket
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    holder = socket.socket()
    holder.bind(("0.0.0.0", 0))
    holder.listen(1)
    port = holder.getsockname()[1]
    try:
        for override in (f"weight_sync.master_port={port}", "weight_sync.master_addr=192.0.2.1"):
            with pytest.raises(ConfigError, match=r"weight_sync\.master_addr=.* / weight_sync\.master_port=.*cannot "
                                                  r"listen there.*set weight_sync\.master_addr"):
                preflight.check_backends(load_config("recipes/tiny_cpu.yaml", [override]))
        monkeypatch.setenv("RANK", "1")                  # only global rank 0 hosts it
        monkeypatch.setenv("WORLD_SIZE", "2")
        preflight.check_backends(load_config("recipes/tiny_cpu.yaml", [f"weight_sync.master_port={port}"]))
    finally:
        holder.close()
    monkeypatch.setenv("RANK", "0")
    preflight.check_backends(load_config("recipes/tiny_cpu.yaml", ["weight_sync.master_addr=127.0.0.1"]))
    # the files route has no rendezvous: its address is refused as unused, and nothing is checked
    with pytest.raises(ConfigError, match=r"weight_sync\.master_addr='192\.0\.2\.1': is not used with "
                                          r"weight_sync\.transport=files"):
        load_config("recipes/tiny_cpu.yaml", ["weight_sync.transport=files", "weight_sync.master_addr=192.0.2.1"])
    preflight.check_backends(load_config("recipes/tiny_cpu.yaml", ["weight_sync.transport=files"]))
