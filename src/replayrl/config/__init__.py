"""Run configuration: one frozen dataclass per concern, loaded from YAML plus overrides.

Every knob is documented once, where it is defined, as field metadata (`metadata={"help":
...}`): `replayrl config explain [SECTION]` prints it and docs/configuration.md is generated
from it (`replayrl config docs`). Loading rejects unknown keys and names the nearest valid
one; each section checks its own fields (`check()`), replayrl.config.run the rules across
sections, and every message says how to fix the config.

The package is the bottom layer of replayrl: it imports nothing of replayrl but
replayrl.errors, knows nothing about models, storage or trackers, and reads the environment
only in replayrl.config.env.

  schema.py        model, task, rollout, eval sections; hub_id
  training.py      buffer, train sections
  asynchronous.py  asynchronous section
  infra.py         tracking, storage, kubernetes sections
  run.py           RunConfig, derived quantities, config hash, arms, cross-section rules
  ranges.py        allowed values of numeric knobs (field metadata), NaN and ±inf refused
  load.py          YAML, --set overrides, load_config, config_from_dict
  env.py           cache dir, temp root, CLI log file, MLflow URI, KFP connection from the env
  explain.py       `replayrl config explain` text and docs/configuration.md
"""

from replayrl.config.asynchronous import AsyncConfig
from replayrl.config.env import (
    cli_log_file,
    default_cache_dir,
    kfp_connection_from_env,
    temp_root,
    tracking_uri_from_env,
)
from replayrl.config.infra import KubernetesConfig, StorageConfig, TrackingConfig
from replayrl.config.load import config_from_dict, load_config, parse_overrides
from replayrl.config.run import (
    ARMS,
    HASH_DEFAULTS_OMITTED,
    HASH_EXEMPT_TRAIN_KEYS,
    SECTIONS,
    RunConfig,
    apply_arm,
    async_max_unused_rows,
    async_min_rows,
    validate,
    validate_async,
    validate_sizes,
    validate_tensor_parallel,
)
from replayrl.config.schema import (
    DATA_SUFFIXES,
    HF_PREFIX,
    TINY_VOCAB_SIZE,
    EvalConfig,
    ModelConfig,
    RolloutConfig,
    TaskConfig,
    hub_id,
)
from replayrl.config.training import BufferConfig, TrainConfig

__all__ = [
    "ARMS",
    "DATA_SUFFIXES",
    "HASH_DEFAULTS_OMITTED",
    "HASH_EXEMPT_TRAIN_KEYS",
    "HF_PREFIX",
    "SECTIONS",
    "TINY_VOCAB_SIZE",
    "AsyncConfig",
    "BufferConfig",
    "EvalConfig",
    "KubernetesConfig",
    "ModelConfig",
    "RolloutConfig",
    "RunConfig",
    "StorageConfig",
    "TaskConfig",
    "TrackingConfig",
    "TrainConfig",
    "apply_arm",
    "async_max_unused_rows",
    "async_min_rows",
    "cli_log_file",
    "config_from_dict",
    "default_cache_dir",
    "hub_id",
    "kfp_connection_from_env",
    "load_config",
    "parse_overrides",
    "temp_root",
    "tracking_uri_from_env",
    "validate",
    "validate_async",
    "validate_sizes",
    "validate_tensor_parallel",
]
