"""Secret settings: the API keys a run authenticates with, used but never written nor sent.

`SECRETS` lists them: the engine servers' key (the only guard on their weight routes and
/collective_rpc) and the agent service's. Each may be given three ways, first found wins:
- the setting itself (`rollout.engines.api_key=...`): it works, but shows in the process list;
- a file named by `<setting>_file`, read here when the config loads; it must be owner-only
  (no group or other permission bits) or the run is refused, naming the setting, the file and
  the fix;
- the environment variable (`$MEGARL_ENGINE_API_KEY`, `$MEGARL_SERVICE_API_KEY`), read by the
  code that uses the key (rollout/engines/build.py, service/launch.py), as before.

Every writer of a config writes `redacted(cfg)` (the run dir's and each checkpoint's config.yaml,
W&B's config, `megarl plan --config`), where a set key is `REDACTED`; error messages show
`shown(key, value)`. A saved config loads back with the placeholder read as no key at all (the
key then comes from its file, the environment, or is a new one): it never authenticates.
"""
from __future__ import annotations

import os
import stat
from dataclasses import dataclass

from omegaconf import DictConfig, OmegaConf

from megarl.config.errors import ConfigError
from megarl.config.renames import ALIASES, MOVED

REDACTED = "<redacted>"


@dataclass(frozen=True)
class Secret:
    key: str     # the setting, dotted
    env: str     # the environment variable read when neither the setting nor its file is given
    file: str    # the setting naming an owner-only file that holds it


SECRETS = (Secret("rollout.engines.api_key", "MEGARL_ENGINE_API_KEY", "rollout.engines.api_key_file"),
           Secret("service.api_key", "MEGARL_SERVICE_API_KEY", "service.api_key_file"))
SECRET_KEYS = frozenset(s.key for s in SECRETS)


def from_env(key: str) -> str:
    """The secret `key` from its environment variable ("" when unset)."""
    return next(os.environ.get(s.env, "") for s in SECRETS if s.key == key)


def shown(key: str, value):
    """`value` as a message may show it: REDACTED for a set secret."""
    return REDACTED if key in SECRET_KEYS and value else value


def _section(cfg, dotted: str):
    *path, name = dotted.split(".")
    for part in path:
        cfg = getattr(cfg, part)
    return cfg, name


def values(cfg) -> list[str]:
    """The secrets `cfg` (a RootConfig) holds: what must appear in nothing written."""
    out = []
    for s in SECRETS:
        section, name = _section(cfg, s.key)
        value = getattr(section, name)
        if value and value != REDACTED:
            out.append(value)
    return out


#: settings naming local files or folders: written absolute, so a saved config.yaml means the
#: same files from any working directory (a relative path is this process's cwd's)
PATH_SETTINGS = ("model.path", "model.megatron_path", "data.prompts", "reward.model_path", "eval.datasets",
                 "run.dir", "checkpoint.dir", "weight_sync.staging_dir", "rollout.engines.api_key_file",
                 "service.api_key_file")


def _absolute(value):
    """A path text made absolute ("" and URLs as they are); a list of them item by item."""
    if isinstance(value, str):
        return os.path.abspath(value) if value and "://" not in value else value
    if isinstance(value, list):
        return [_absolute(v) for v in value]
    if isinstance(value, dict):   # a data.prompts mixture: {file: weight}, or an entry {path, weight}
        if set(value) == {"path", "weight"}:
            return {**value, "path": _absolute(value["path"])}
        return {_absolute(k): w for k, w in value.items()}
    return value


def redacted(cfg) -> DictConfig:
    """`cfg` (a RootConfig) as a DictConfig with every set secret replaced by REDACTED and the
    paths of PATH_SETTINGS absolute; `cfg` is unchanged."""
    out = OmegaConf.structured(cfg)
    for s in SECRETS:
        if OmegaConf.select(out, s.key):
            OmegaConf.update(out, s.key, REDACTED)
    for key in PATH_SETTINGS:
        value = OmegaConf.select(out, key, default=None)
        value = OmegaConf.to_container(value) if OmegaConf.is_config(value) else value
        if isinstance(value, (str, list, dict)):
            OmegaConf.update(out, key, _absolute(value), merge=False)
    return out


def redacted_yaml(cfg) -> str:
    return OmegaConf.to_yaml(redacted(cfg))


def redacted_dict(cfg) -> dict:
    return OmegaConf.to_container(redacted(cfg))


def scrub(text: str, secrets) -> str:
    """`text` with each of `secrets` replaced by REDACTED."""
    for value in secrets:
        text = text.replace(value, REDACTED)
    return text


def read_key_file(setting: str, path: str) -> str:
    """The key in the file `path` (named by `setting`): refused unless owner-only and non-empty."""
    try:
        mode = os.stat(path).st_mode
        with open(path, encoding="utf-8") as f:
            key = f.read().strip()
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"{setting}={path!r}: cannot be read ({err.__class__.__name__}: "
                          f"{getattr(err, 'strerror', None) or err}): give a file holding the key, "
                          f"readable by you only (chmod 600)") from None
    if mode & 0o077:
        raise ConfigError(f"{setting}={path!r}: others may read it (mode {stat.S_IMODE(mode):04o}): "
                          f"chmod 600 {path}, then run again")
    if not key:
        raise ConfigError(f"{setting}={path!r}: is empty: write the key in it (one line), or remove {setting}")
    return key


def resolve(cfg):
    """Fill each secret of `cfg` (a RootConfig, in place) from its file when one is named; a
    saved config's placeholder reads as no key. Returns `cfg`."""
    for s in SECRETS:
        section, name = _section(cfg, s.key)
        _, file_name = _section(cfg, s.file)
        value, path = getattr(section, name), getattr(section, file_name)
        if value == REDACTED:
            value = ""
        if path and value:
            raise ConfigError(f"{s.key}={REDACTED!r}: {s.file} is set too: give the key one way (the file keeps "
                              f"it out of the process list), and remove the other")
        setattr(section, name, read_key_file(s.file, path) if path else value)
    return cfg


def redacted_overrides(args: list[str]) -> list[str]:
    """Command-line overrides (`key=value`) as a log may keep them: a secret's value, under its
    key or an old name of it (renames.MOVED and ALIASES), is REDACTED."""
    out = []
    for arg in args:
        key, sep, value = arg.partition("=")
        if sep and value and {**MOVED, **ALIASES}.get(key, key) in SECRET_KEYS:
            arg = f"{key}={REDACTED}"
        out.append(arg)
    return out


if __name__ == "__main__":   # slurm/common.sh: a job's overrides.txt, one override a line
    import sys
    print("\n".join(redacted_overrides(sys.argv[1:])))

