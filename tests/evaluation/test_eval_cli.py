"""The top-level shortcuts of conf/eval.yaml (``decoding=``, ``gamma=``, ``gammas=``, ``drafter=``).

``main`` itself runs end to end in tests/scripts/test_evaluate_script.py.
"""

from __future__ import annotations

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from tests.conftest import CONF_DIR
from train.cli.evaluate_command import apply_shortcuts
from train.config import ConfigError
from train.evaluation import build_eval_config


def _eval_cfg(overrides: list[str]):
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="eval", overrides=overrides, return_hydra_config=True)
    apply_shortcuts(cfg)
    return build_eval_config(cfg.eval)


def test_decoding_choice_labels_the_default_entry():
    assert list(_eval_cfg([]).decoder_configs) == ["sd"]
    cfg = _eval_cfg(["decoding=sd_g2", "decoding.eps=0.5", "decoding.lenience=squared"])
    assert cfg.decoder_configs == {
        "sd_g2": {
            "_target_": "train.decoding.SpeculativeDecoder",
            "gamma": 2,
            "lenience": "squared",
            "eps": 0.5,
            "plain_steps": "auto",
            "fallback_cut": True,
        }
    }


def test_gamma_sets_the_chosen_config_and_gammas_sweeps():
    assert _eval_cfg(["decoding=sd", "gamma=8"]).decoder_configs["sd"]["gamma"] == 8
    assert list(_eval_cfg(["gammas=[1,2]"]).decoder_configs) == ["sd@g1", "sd@g2"]
    assert list(_eval_cfg(["eval.decoders=[sd,sd_g2]"]).decoder_configs) == ["sd", "sd_g2"]


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (["gamma=0"], "gamma"),
        (["eval.decoders=[sd,sd_g2]", "gamma=2"], "gamma"),
        (["gammas=[2,0]"], "eval.gammas"),
        (["decoding.eps=2.0"], r"eval\.decoders\[sd\]\.eps"),
        (["eval.decoders=[foo]"], r"eval\.decoders: unknown decoder config 'foo'"),
        (["drafter=/no/such/drafter"], "drafter"),
    ],
)
def test_bad_shortcuts_name_the_key(overrides, key):
    with pytest.raises(ConfigError, match=f"^{key}"):
        _eval_cfg(overrides)
