"""Every YAML under conf/ composes, and bad values fail at start-up naming the key."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import OmegaConf, open_dict

from tests.conftest import CONF_DIR
from train.cli.train_command import load_spec
from train.config import ConfigError, LoggerConfig, TrainerConfig, check_model_source

GROUP_DIRS = sorted(p for p in CONF_DIR.iterdir() if p.is_dir() and p.name != "hydra")
ENTRY_FILES = sorted(p.stem for p in CONF_DIR.glob("*.yaml"))


def _compose(config_name: str, overrides: list[str]) -> object:
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name=config_name, overrides=overrides, return_hydra_config=True)


def _options(group_dir: Path) -> list[str]:
    return sorted(p.stem for p in group_dir.glob("*.yaml"))


def _group_case(group_dir: Path, option: str) -> tuple[str, list[str]]:
    """Which entry config a group belongs to and the override selecting ``option``."""
    if group_dir.name == "decoding":
        return "eval", [f"decoding={option}"]
    return "train", [f"{group_dir.name}={option}"]


CASES = [(g.name, option) for g in GROUP_DIRS for option in _options(g)]


@pytest.mark.parametrize(("group", "option"), CASES)
def test_every_group_option_composes(group: str, option: str) -> None:
    config_name, overrides = _group_case(CONF_DIR / group, option)
    cfg = _compose(config_name, overrides)
    assert cfg is not None


@pytest.mark.parametrize("config_name", ENTRY_FILES)
def test_every_entry_config_composes(config_name: str) -> None:
    assert _compose(config_name, []) is not None


def _spec_cfg(overrides: list[str], tmp_path: Path):
    cfg = _compose("train", overrides + [f"paths.root_dir={tmp_path}"])
    with open_dict(cfg):
        cfg.paths.run_dir = str(tmp_path / "run")
        del cfg["hydra"]
    return cfg


def test_default_config_validates(tmp_path: Path) -> None:
    spec = load_spec(_spec_cfg([], tmp_path))
    assert spec.trainer.accelerator == "cpu"
    assert spec.model.tiny is not None
    assert spec.logger.wandb and spec.logger.csv
    assert spec.data.name and spec.callbacks  # typed at start-up: a data source, built callbacks
    assert all(hasattr(cb, "setup") for cb in spec.callbacks)


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("method.optimizer.lr=-1e-3", "method.optimizer.lr"),
        ("trainer.strategy=magic", "trainer.strategy"),
        ("trainer.devices=0", "trainer.devices"),
        ("trainer.max_steps=0", "trainer.max_steps"),
        ("model.tiny=null", "model.verifier"),
        ("model.tiny.verifier.lr=0", "model.tiny.*.lr"),
        ("model=qwen3,model.drafter=/no/such/folder", "model.drafter"),
        ("logger.offline=maybe", "logger.offline"),
        ("model.dtype=float8", "model.dtype"),
        ("callbacks.model_checkpoint.every_n_train_steps=-5", "callbacks.model_checkpoint"),
        ("+callbacks.mine._target_=no.such.Callback", "callbacks.mine"),
    ],
)
def test_bad_values_fail_naming_the_key(override: str, key: str, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=re.escape(key)):
        load_spec(_spec_cfg(override.split(","), tmp_path))


def test_trainer_config_ranges() -> None:
    with pytest.raises(ConfigError, match=r"trainer\.accumulate_grad_batches"):
        TrainerConfig(accumulate_grad_batches=0)
    assert TrainerConfig(devices="auto").trainer_kwargs()["devices"] == "auto"


def test_model_source_rules(tmp_path: Path) -> None:
    check_model_source("model.verifier", "Qwen/Qwen3-8B")  # a Hub id is fine offline
    check_model_source("model.verifier", str(tmp_path))  # an existing folder
    with pytest.raises(ConfigError, match="no model folder"):
        check_model_source("model.verifier", str(tmp_path / "missing"))
    with pytest.raises(ConfigError, match="Hub id"):
        check_model_source("model.verifier", "not a valid id!")


def test_wandb_offline_unless_credentials(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    assert LoggerConfig().wandb_offline()
    monkeypatch.setenv("WANDB_API_KEY", "x")
    assert not LoggerConfig().wandb_offline()
    assert LoggerConfig(offline=True).wandb_offline()
    monkeypatch.setenv("WANDB_MODE", "offline")  # wandb's own switch wins over a key
    assert LoggerConfig().wandb_offline()


def test_experiments_carry_their_run_command() -> None:
    for path in (CONF_DIR / "experiment").glob("*.yaml"):
        text = path.read_text()
        assert text.startswith("# @package _global_"), path
        assert "python train.py experiment=" in text, path
        assert OmegaConf.load(path).get("name"), path


def test_renamed_targets_point_at_what_exists_and_old_configs_still_build():
    """Configs written for the old layout keep working, with a deprecation line naming the new target."""
    from hydra.utils import get_method, get_object
    from omegaconf import OmegaConf

    from train.config import RENAMED_TARGETS, instantiate_group

    for old, new in RENAMED_TARGETS.items():
        assert new != old
        assert get_object(new) is not None or get_method(new) is not None, new
    cfg = OmegaConf.create({"cb": {"_target_": "train.callbacks.NonFiniteLossGuard"}})
    with pytest.warns(DeprecationWarning, match="train.callbacks.NonFiniteLossGuard is deprecated"):
        guard = instantiate_group(cfg, "cb")
    from train.training.callbacks import NonFiniteLossGuard

    assert isinstance(guard, NonFiniteLossGuard)


def test_renamed_top_k_settings_still_build_with_a_deprecation_line(tmp_path: Path) -> None:
    """Issue 53 keeps ``top_k`` for the sampling cut-off only (RENAMED_KEYS): EAGLE-3's tree width is
    ``branching``, the log-probabilities kept per answer token ``top_logprobs``. The old keys, in a config
    or on the command line (which check_overrides turns into additions), build the new settings with a
    deprecation line naming both; a Python call with the old keyword names the new one."""
    from train.cli.console import check_overrides
    from train.cli.evaluate_command import apply_shortcuts
    from train.config import instantiate_group, renamed_targets
    from train.evaluation import build_eval_config
    from train.pairs.smollm2_pair import SmolDrafterRecipe, SmolPairConfig

    argv = check_overrides(str(CONF_DIR), "eval", ["decoding=eagle3", "decoding.top_k=2"])
    assert argv == ["decoding=eagle3", "+decoding.top_k=2"]
    cfg = _compose("eval", argv)
    apply_shortcuts(cfg)
    with pytest.warns(
        DeprecationWarning, match=r"eval.decoders\[eagle3\].top_k is deprecated; it is now .*branching"
    ):
        settings = build_eval_config(cfg.eval).decoder_configs["eagle3"]
    assert settings["branching"] == 2 and "top_k" not in settings
    old_file = {"_target_": "train.decoding.Eagle3Decoder", "depth": 3, "top_k": 1, "total_tokens": 3}
    with pytest.warns(DeprecationWarning, match="top_k is deprecated; it is now branching"):
        renamed_targets(old_file)  # a decoder config written before: renamed in place
    assert old_file == {
        "_target_": "train.decoding.Eagle3Decoder",
        "depth": 3,
        "branching": 1,
        "total_tokens": 3,
    }

    argv = check_overrides(str(CONF_DIR), "train", ["model=smollm2", "model.smollm2.top_k=8"])
    assert argv == ["model=smollm2", "+model.smollm2.top_k=8"]
    with pytest.warns(
        DeprecationWarning, match="model.smollm2.top_k is deprecated; it is now model.smollm2.top_logprobs"
    ):
        model = instantiate_group(_compose("train", argv), "model")
    assert model.smollm2.top_logprobs == 8
    with pytest.raises(TypeError, match="SmolPairConfig.*'top_k', renamed .*: use top_logprobs="):
        SmolPairConfig(out_dir=str(tmp_path), drafter=SmolDrafterRecipe(), top_k=8)  # type: ignore[call-arg]


def test_dflash_gamma_is_read_as_slot_decay_with_a_deprecation_line() -> None:
    """DFlash's slot weight decay was ``gamma``, the chain's draft length everywhere else: the old key, on
    the command line, builds ``slot_decay`` with a deprecation line naming both."""
    from train.cli.console import check_overrides
    from train.config import instantiate_group

    argv = check_overrides(str(CONF_DIR), "train", ["method=dflash", "method.gamma=3.0"])
    assert argv == ["method=dflash", "+method.gamma=3.0"]
    with pytest.warns(DeprecationWarning, match="method.gamma is deprecated; it is now method.slot_decay"):
        settings = instantiate_group(_compose("train", argv), "method")
    assert settings.slot_decay == 3.0 and not hasattr(settings, "gamma")


def test_the_async_decoders_max_block_is_read_as_gamma_with_a_deprecation_line() -> None:
    """The asynchronous decoder's draft length was ``max_block``; it is ``gamma`` as every chain's. An old
    decoder config builds with a deprecation line; a Python call with the old keyword names the new one."""
    from train.config import renamed_targets
    from train.decoding import AsyncSpeculativeDecoder

    old_file = {"_target_": "train.decoding.AsyncSpeculativeDecoder", "max_block": 4, "idle": "step"}
    with pytest.warns(DeprecationWarning, match="max_block is deprecated; it is now gamma"):
        renamed_targets(old_file)
    assert old_file == {"_target_": "train.decoding.AsyncSpeculativeDecoder", "gamma": 4, "idle": "step"}
    with pytest.raises(TypeError, match="'max_block', renamed .*: use gamma="):
        AsyncSpeculativeDecoder(None, None, max_block=4)  # type: ignore[arg-type,call-arg]


def test_the_old_decoder_name_still_imports_with_a_deprecation_line():
    import train.decoding as decoding

    with pytest.warns(DeprecationWarning, match="MedusaDecoder is deprecated; it is now HeadsDecoder"):
        assert decoding.MedusaDecoder is decoding.HeadsDecoder


def test_a_wall_clock_budget_goes_to_lightning_and_a_bad_one_names_its_key() -> None:
    from train.cli.train_command import ended_between_validations

    cfg = TrainerConfig(max_time="00:00:04:00", max_steps=1000)
    assert cfg.trainer_kwargs()["max_time"] == "00:00:04:00"
    assert TrainerConfig().trainer_kwargs()["max_time"] is None
    for bad in ("4 minutes", "00:04:00", "00:00:-1:00"):
        with pytest.raises(ConfigError, match="trainer.max_time"):
            TrainerConfig(max_time=bad)
    stopped_early, finished = SimpleNamespace(global_step=40), SimpleNamespace(global_step=1000)
    assert ended_between_validations(stopped_early, cfg)
    assert not ended_between_validations(finished, cfg)
    assert not ended_between_validations(stopped_early, TrainerConfig(max_steps=1000))
    assert not ended_between_validations(stopped_early, cfg, [{"step": 0.0}, {"step": 40.0}])
    assert ended_between_validations(stopped_early, cfg, [{"step": 0.0}])
