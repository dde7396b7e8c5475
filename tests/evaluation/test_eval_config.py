"""EvalConfig and decoder configs: names and inline mappings resolve, the gamma sweep expands, and every
bad value fails naming its key."""

from __future__ import annotations

import dataclasses

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.utils import instantiate

from tests.conftest import CONF_DIR, tiny_llama
from tests.evaluation.fakes import RecordingDecoder, inline
from train.config import ConfigError
from train.decoding import SpeculativeDecoder
from train.decoding.decoders.tree_decoder import tree_size
from train.evaluation import EvalConfig, build_decoders, build_eval_config, known_decoder_configs
from train.evaluation.decoder_build import accepted_kinds
from train.models.dflash_drafter import DFlashDrafter
from train.models.draft_vocab import DraftVocabModel, set_draft_vocab
from train.models.eagle3_drafter import Eagle3Drafter
from train.models.heads import MedusaHeads
from train.models.ngram import NGramLM
from train.models.steering_module import SteeredDrafter, SteeringModule

SD = "train.decoding.SpeculativeDecoder"


def _compose(config_name: str, overrides: list[str]):
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name=config_name, overrides=overrides)


def test_defaults_fit_the_main_job():
    cfg = EvalConfig()
    assert cfg.temperatures == [0.0, 1.0] and cfg.seeds == [0, 1] and cfg.gammas is None
    assert cfg.decoder_configs == {
        "sd": {
            "_target_": SD,
            "gamma": 4,
            "lenience": None,
            "eps": 1.0,
            "confidence_threshold": 0.0,
            "lookup_tokens": 0,
            "lookup_max_ngram": 3,
            "lookup_min_ngram": 2,
            "plain_steps": "auto",
            "fallback_cut": True,
        }
    }
    assert not hasattr(cfg, "lenience") and not hasattr(cfg, "eps")


def test_decoders_by_name_and_inline():
    cfg = build_eval_config(
        {
            "decoders": [
                "sd",
                "sd_g2",
                {"_target_": SD, "name": "lossy", "gamma": 3, "lenience": "linear", "eps": 0.5},
            ]
        }
    )
    assert list(cfg.decoder_configs) == ["sd", "sd_g2", "lossy"]
    assert cfg.decoder_configs["sd_g2"]["gamma"] == 2
    assert cfg.decoder_configs["lossy"] == {"_target_": SD, "gamma": 3, "lenience": "linear", "eps": 0.5}
    # an unnamed inline config is labelled by its class
    assert list(EvalConfig(decoders=[{"_target_": SD}]).decoder_configs) == ["speculativedecoder"]
    # normalised entries survive a round trip through asdict (results.json records the config)
    assert EvalConfig(**dataclasses.asdict(cfg)).decoder_configs == cfg.decoder_configs
    assert {"sd", "sd_g2"} <= set(known_decoder_configs())


def test_gamma_sweep_expands_configs_with_a_gamma():
    cfg = EvalConfig(decoders=["sd", inline(RecordingDecoder, "rec")], gammas=[1, 2, 4])
    assert list(cfg.decoder_configs) == ["sd@g1", "sd@g2", "sd@g4", "rec"]
    assert [cfg.decoder_configs[f"sd@g{g}"]["gamma"] for g in (1, 2, 4)] == [1, 2, 4]


def test_decoder_configs_build_as_partials(tmp_path):
    verifier, drafter = tiny_llama(seed=0), tiny_llama(seed=1)
    decoders = build_decoders(verifier, drafter, EvalConfig(decoders=["sd", "sd_g2"]))
    assert isinstance(decoders["sd"], SpeculativeDecoder) and decoders["sd"].gamma == 4
    assert decoders["sd_g2"].gamma == 2 and decoders["sd_g2"].drafter is drafter
    trees = build_decoders(verifier, drafter, EvalConfig(decoders=["specinfer", "rsd_c", "rsd_s"]))

    def max_tree_tokens(d):  # the most draft tokens one block scores
        return d.depth * d.beam_width if d.method == "rsd_s" else tree_size(d.branching)

    assert {name: (d.method, max_tree_tokens(d)) for name, d in trees.items()} == {
        "specinfer": ("specinfer", 10),
        "rsd_c": ("rsd_c", 10),
        "rsd_s": ("rsd_s", 9),
    }
    # each conf/decoding/*.yaml is a partial in its own right: factory(verifier, drafter or heads); the
    # BPD configs find n-gram models under ${heads} and a rescoring LM at ${model.drafter}
    heads = MedusaHeads.from_verifier(verifier, 4, 1)
    heads.save_pretrained(tmp_path / "heads")
    for order in (2, 4):
        NGramLM(order, verifier.config.vocab_size).fit([list(range(50)) * 3]).save(
            tmp_path / "heads" / f"ngram_{order}"
        )
    drafter.save_pretrained(tmp_path / "drafter")
    SteeringModule.for_pair(verifier, drafter).save_pretrained(tmp_path / "steering")
    eagle3 = Eagle3Drafter.from_verifier(verifier, aux_layers=[0, 1, 1])  # tiny_llama has 2 layers
    eagle3.save_pretrained(tmp_path / "eagle3")
    eagle3 = Eagle3Drafter.from_pretrained(tmp_path / "eagle3")
    dflash = DFlashDrafter.from_verifier(verifier, aux_layers=[0, 1, 1])
    overrides = [
        f"heads={tmp_path / 'heads'}",
        f"eagle3={tmp_path / 'eagle3'}",
        f"model.drafter={tmp_path / 'drafter'}",
        f"steering={tmp_path / 'steering'}",
    ]
    for name in known_decoder_configs():
        factory = instantiate(_compose("eval", [f"decoding={name}", *overrides]).decoding)
        kinds = accepted_kinds(factory.func)
        by_kind = {"heads": heads, "eagle3": eagle3, "dflash": dflash}
        second = next((by_kind[k] for k in kinds if k in by_kind), drafter)
        assert factory(verifier, second).verifier is verifier, name
    dflash_configs = {
        "dflash_cost",
        "dflash_tree",
        "dflash_lookup",
        "dflash_tree_lookup",
        "dflash_sampled_tree_lookup",
    }
    assert {"eagle3", "dflash", *dflash_configs} <= set(known_decoder_configs())


@pytest.mark.parametrize(
    ("node", "key"),
    [
        ({"decoders": ["foo"]}, "eval.decoders: unknown decoder config 'foo'; known: ["),
        ({"decoders": []}, "eval.decoders"),
        ({"decoders": [{"gamma": 2}]}, "eval.decoders[0]._target_"),
        ({"decoders": [{"_target_": "no.such.Decoder"}]}, "eval.decoders[decoder]._target_"),
        ({"decoders": [{"_target_": SD, "gama": 2}]}, "eval.decoders[speculativedecoder]"),
        ({"decoders": [{"_target_": SD, "name": "x", "gamma": 0}]}, "eval.decoders[x].gamma"),
        ({"decoders": [{"_target_": SD, "name": "x", "lenience": "lax"}]}, "eval.decoders[x].lenience"),
        ({"decoders": [{"_target_": SD, "name": "x", "eps": 0.0}]}, "eval.decoders[x].eps"),
        ({"decoders": [{"_target_": SD, "name": "a/b"}]}, "eval.decoders[a/b].name"),
        ({"decoders": ["sd", {"_target_": SD, "name": "sd"}]}, "eval.decoders"),
        ({"decoders": [inline(RecordingDecoder, "rec")], "gammas": [2]}, "eval.gammas"),
        ({"gammas": [0]}, "eval.gammas"),
        ({"gammas": [2, 2]}, "eval.gammas"),
        ({"temperatures": [-0.5]}, "eval.temperatures"),
        ({"seeds": [0, 0]}, "eval.seeds"),
        ({"num_prompts": 0}, "eval.num_prompts"),
        ({"prompt_len": 1}, "eval.prompt_len"),
        ({"max_new_tokens": 0}, "eval.max_new_tokens"),
        ({"top_p": 1.5}, "eval.top_p"),
        ({"top_k": -1}, "eval.top_k"),
        ({"tie_ulps": -1}, "eval.tie_ulps"),
        ({"num_threads": 0}, "eval.num_threads"),
        ({"strict_greedy": "yes"}, "eval.strict_greedy"),
        ({"lenience": "linear"}, "eval.lenience: unknown key"),
        ({"eps": 0.5}, "eval.eps: unknown key"),
    ],
)
def test_bad_values_name_the_key(node, key):
    with pytest.raises(ConfigError) as err:
        build_eval_config(node)
    assert str(err.value).startswith(key), str(err.value)


def test_the_eval_group_composes_in_both_entry_configs():
    train = _compose("train", [])
    assert build_eval_config(train.eval).decoder_configs == EvalConfig().decoder_configs
    train = _compose("train", ["eval.decoders=[sd,sd_g2]", "eval.gammas=[1,2]"])
    assert list(build_eval_config(train.eval).decoder_configs) == ["sd@g1", "sd@g2", "sd_g2@g1", "sd_g2@g2"]
    ev = _compose("eval", ["decoding=sd_g2", "decoding.eps=0.5", "decoding.lenience=linear"])
    (settings,) = build_eval_config(ev.eval).decoder_configs.values()
    assert settings == {
        "_target_": SD,
        "gamma": 2,
        "lenience": "linear",
        "eps": 0.5,
        "plain_steps": "auto",
        "fallback_cut": True,
    }
    assert _compose("eval", ["gammas=[1,2,4,8]"]).eval.gammas == [1, 2, 4, 8]


def test_idle_threads_leave_the_cores_other_processes_use(monkeypatch) -> None:
    """``eval.num_threads: idle``: as many torch threads as cores no other process keeps busy, at least 1
    (threads on a core another process holds spin-wait for each other)."""
    import train.hardware as hardware

    monkeypatch.setattr(hardware.os, "cpu_count", lambda: 4)
    for busy, threads in ((0.0, 4), (0.2, 4), (1.0, 3), (1.6, 2), (7.5, 1)):
        monkeypatch.setattr(hardware, "busy_cores_elsewhere", lambda s=0.5, b=busy: b)
        assert hardware.idle_cores() == threads
    assert build_eval_config({"num_threads": "idle"}).num_threads == "idle"
    with pytest.raises(ConfigError, match="eval.num_threads"):
        build_eval_config({"num_threads": "all"})


def test_busy_cores_elsewhere_sees_another_process_spinning() -> None:
    import subprocess
    import sys

    from train.hardware import busy_cores_elsewhere

    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        assert busy_cores_elsewhere(0.5) > 0.5
    finally:
        spinner.kill()


def test_a_drafter_with_a_draft_vocabulary_drafts_over_it_steered_or_not():
    """A model or a steered drafter whose config names a draft vocabulary reaches its decoders wrapped
    (its head over those ids only, as in training); unwrapped, the steered drafter computed its head over
    the whole vocabulary every step, 2-3x its cost."""
    verifier, drafter = tiny_llama(seed=0), tiny_llama(seed=1)
    set_draft_vocab(drafter, list(range(0, 64)))
    steering = SteeringModule.for_pair(verifier, drafter)
    plain = build_decoders(verifier, drafter, EvalConfig(decoders=["sd"]))["sd"]
    steered = build_decoders(verifier, SteeredDrafter(drafter, steering), EvalConfig(decoders=["sd"]))["sd"]
    for decoder in (plain, steered):
        assert isinstance(decoder.drafter, DraftVocabModel) and decoder.drafter.model is drafter
    assert steered.steering is steering and plain.steering is None
