"""scripts/evaluate.py and scripts/export.py: compose, run on tiny saved models, fail early on bad values."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

from tests.conftest import CONF_DIR, REPO_ROOT, make_tokenizer
from train.cli.evaluate_command import main as evaluate_main
from train.cli.export_command import main as export_main
from train.config import ConfigError
from train.export.drafter import export_drafter
from train.models.loading import TokenizerMismatchError

TEXT = "def add(a, b):\n    return a + b  # a docstring follows\n"


def _compose(config_name: str, overrides: list[str], hydra_node: bool = False):
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name=config_name, overrides=overrides, return_hydra_config=hydra_node)


@pytest.fixture(scope="module")
def data_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": TEXT * (i % 3 + 2)}) + "\n" for i in range(8)))
    return path


@pytest.fixture(scope="module")
def exported(tiny_pair_dir, tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("train_run")
    drafter = AutoModelForCausalLM.from_pretrained(tiny_pair_dir / "drafter")
    export_drafter(drafter, make_tokenizer(), run / "drafter", config={"name": "t"})
    return run


def _eval_overrides(pair: Path, data: Path, run_dir: Path) -> list[str]:
    return [
        f"model.verifier={pair / 'verifier'}",
        f"model.drafter={pair / 'drafter'}",
        "model.tiny=null",
        "data=local",
        f"data.data_files={data}",
        "data.test_fraction=0.5",
        "logger=none",
        "eval.num_prompts=2",
        "eval.prompt_len=12",
        "eval.max_new_tokens=6",
        "eval.seeds=[0]",
        "eval.progress=false",
        f"paths.root_dir={run_dir.parent}",
        f"hydra.run.dir={run_dir}",
    ]


def test_eval_and_export_configs_compose():
    cfg = _compose("eval", ["decoding=sd", "gamma=8"])
    assert cfg.decoding.gamma == 4 and cfg.gamma == 8 and cfg.gammas is None  # gamma applies in main
    assert cfg.eval.temperatures == [0.0, 1.0] and cfg.eval._target_ == "train.evaluation.EvalConfig"
    assert _compose("eval", ["gammas=[1,2,4,8]"]).eval.gammas == [1, 2, 4, 8]
    cfg = _compose("export", ["run=/some/run", "hub.repo_id=me/my-drafter", "hub.dry_run=true"])
    assert cfg.hub.repo_id == "me/my-drafter" and cfg.hub.dry_run is True


@pytest.mark.slow
def test_evaluate_script_end_to_end(tiny_pair_dir, data_file, exported, tmp_path):
    """The real Hydra app in a subprocess: an exported drafter under two decoder configs, one table."""
    run_dir = tmp_path / "eval_run"
    overrides = _eval_overrides(tiny_pair_dir, data_file, run_dir)
    cmd = [
        sys.executable,
        "scripts/evaluate.py",
        *overrides,
        f"drafter={exported / 'drafter'}",
        "eval.decoders=[sd,sd_g2]",
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((run_dir / "results.json").read_text())
    name = f"{exported.name}/drafter"
    assert list(results["models"]["drafters"]) == [name]
    assert {(r["decoder"], r["gamma"], r["temperature"]) for r in results["runs"]} == {
        ("sd", 4, 0.0),
        ("sd", 4, 1.0),
        ("sd_g2", 2, 0.0),
        ("sd_g2", 2, 1.0),
    }
    assert all(r["greedy_match"] for r in results["runs"] if r["temperature"] == 0.0)
    assert results["prompts"]["n"] == 2 and results["prompts"]["max_len"] <= 12
    for f in ("results.md", "block_efficiency_vs_gamma.png", "per_position_acceptance.png", "config.yaml"):
        assert (run_dir / f).is_file(), f
    assert str(run_dir) in proc.stdout
    assert f"| {name} | sd | 4 | 0 |" in proc.stdout and f"| {name} | sd_g2 | 2 | 0 |" in proc.stdout


def _run_eval_main(pair: Path, data: Path, tmp_path: Path, extra: list[str]):
    cfg = _compose("eval", _eval_overrides(pair, data, tmp_path / "run")[:-1] + extra, hydra_node=True)
    cfg.paths.run_dir = str(tmp_path / "run")
    return evaluate_main(cfg)


def test_two_decoder_configs_one_table(tiny_pair_dir, data_file, tmp_path, capsys):
    """main(cfg) in process: eval.decoders=[sd,sd_g2] gives one row each, on the same prompts,
    in one table."""
    results = _run_eval_main(
        tiny_pair_dir,
        data_file,
        tmp_path,
        ["eval.decoders=[sd,sd_g2]", "eval.temperatures=[0.0]", "eval.plots=false"],
    )
    assert [(r["decoder"], r["gamma"]) for r in results["runs"]] == [("sd", 4), ("sd_g2", 2)]
    assert results["timing"]["order"] == ["ar", "drafter/sd", "drafter/sd_g2"]
    table = (tmp_path / "run" / "results.md").read_text()
    assert table.split("\n\n")[0].count("\n| drafter | sd") == 2
    assert "| drafter | sd | 4 | 0 |" in capsys.readouterr().out


def test_every_eos_id_is_used(tiny_pair_dir, data_file, tmp_path):
    """The tokenizer's EOS and each model's generation_config EOS ids all stop generation."""
    pair = tmp_path / "pair"
    for role in ("verifier", "drafter"):
        model = AutoModelForCausalLM.from_pretrained(tiny_pair_dir / role)
        if role == "verifier":
            model.generation_config.eos_token_id = [257, 258]
        model.save_pretrained(pair / role)
        make_tokenizer().save_pretrained(pair / role)
    results = _run_eval_main(pair, data_file, tmp_path, ["eval.temperatures=[0.0]", "eval.plots=false"])
    assert results["eos_token_ids"] == [257, 258]


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("gamma=0", "gamma"),
        ("gammas=[2,0]", "eval.gammas"),
        ("eval.temperatures=[-1.0]", "eval.temperatures"),
        ("eval.num_prompts=0", "eval.num_prompts"),
        ("decoding.eps=2.0", "eval.decoders[sd].eps"),
        ("eval.decoders=[foo]", "eval.decoders"),
        ("drafter=/no/such/drafter", "drafter"),
        ("model.verifier=/no/such/verifier", "model.verifier"),
    ],
)
def test_bad_values_fail_at_start_up(override, key, tiny_pair_dir, data_file, tmp_path):
    with pytest.raises(ConfigError, match=re.escape(key)):
        _run_eval_main(tiny_pair_dir, data_file, tmp_path, [override])
    assert not (tmp_path / "run" / "config.yaml").exists()  # nothing ran


def _reversed_tokenizer() -> PreTrainedTokenizerFast:
    """Same tokens as make_tokenizer(), other ids: a drafter trained with it cannot serve the verifier."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet(), reverse=True)
    vocab = {tok: i for i, tok in enumerate(alphabet)}
    for special in ("<|bos|>", "<|eos|>", "<|pad|>"):
        vocab[special] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|eos|>", pad_token="<|pad|>"
    )


def test_drafter_with_another_tokenizer_is_refused(tiny_pair_dir, data_file, tmp_path):
    other = tmp_path / "other_drafter"
    AutoModelForCausalLM.from_pretrained(tiny_pair_dir / "drafter").save_pretrained(other)
    _reversed_tokenizer().save_pretrained(other)
    with pytest.raises(TokenizerMismatchError):
        _run_eval_main(tiny_pair_dir, data_file, tmp_path, [f"drafter={other}"])


def test_export_script_dry_run(exported, tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("HF_TOKEN", raising=False)
    cfg = _compose("export", [f"run={exported}", "hub.repo_id=me/my-drafter", "hub.dry_run=true"])
    report = export_main(cfg)
    assert report["dry_run"] and "model.safetensors" in report["files"]
    assert "Would upload" in capsys.readouterr().out
    with pytest.raises(ConfigError, match="no drafter/ folder"):
        export_main(_compose("export", [f"run={tmp_path}", "hub.repo_id=me/x", "hub.dry_run=true"]))
    with pytest.raises(ConfigError, match="hub.repo_id"):
        export_main(_compose("export", [f"run={exported}", "hub.repo_id=bad id", "hub.dry_run=true"]))
    with pytest.raises(ConfigError, match="run"):
        export_main(_compose("export", ["hub.repo_id=me/x"]))


def test_export_script_subprocess_dry_run(exported, tmp_path):
    cmd = [
        sys.executable,
        "scripts/export.py",
        f"run={exported}",
        "hub.repo_id=me/my-drafter",
        "hub.dry_run=true",
        f"hydra.run.dir={tmp_path / 'export_run'}",
    ]
    env = {k: v for k, v in os.environ.items() if k != "HF_TOKEN"}
    proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Would upload" in proc.stdout and "model.safetensors" in proc.stdout


@pytest.fixture(scope="module")
def heads_dir(tiny_pair_dir, tmp_path_factory) -> Path:
    from train.models.heads import MedusaHeads

    verifier = AutoModelForCausalLM.from_pretrained(tiny_pair_dir / "verifier")
    folder = tmp_path_factory.mktemp("medusa_run") / "heads"
    MedusaHeads.from_verifier(verifier, 2, 1).with_tree([[0], [1], [0, 0]]).save_pretrained(folder)
    from train.models.ngram import NGramLM

    documents = [make_tokenizer()(TEXT * 3, add_special_tokens=False)["input_ids"]]
    for order in (2, 4):
        NGramLM(order, verifier.config.vocab_size).fit(documents).save(folder / f"ngram_{order}")
    return folder


def test_drafter_and_heads_in_one_table(tiny_pair_dir, data_file, heads_dir, tmp_path):
    """heads=PATH with eval.decoders=[sd,medusa]: sd runs the drafter, medusa the heads, one table."""
    results = _run_eval_main(
        tiny_pair_dir,
        data_file,
        tmp_path,
        [f"heads={heads_dir}", "eval.decoders=[sd,medusa]", "eval.temperatures=[0.0]", "eval.plots=false"],
    )
    name = "heads"  # the folder's name (a run's <run>/drafter is the only special case)
    assert [(r["drafter"], r["decoder"]) for r in results["runs"]] == [("drafter", "sd"), (name, "medusa")]
    assert all(r["greedy_match"] for r in results["runs"])
    assert results["timing"]["order"] == ["ar", "drafter/sd", f"{name}/medusa"]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["decoding=medusa"], "pass heads=PATH"),
        (["heads=HEADS"], "no decoder in eval.decoders takes heads"),
        (["decoding=medusa", "heads=/no/such/heads"], "heads: no model folder"),
    ],
)
def test_heads_mistakes_fail_at_start_up(extra, message, tiny_pair_dir, data_file, heads_dir, tmp_path):
    extra = [e.replace("HEADS", str(heads_dir)) for e in extra]
    with pytest.raises(ConfigError, match=message):
        _run_eval_main(tiny_pair_dir, data_file, tmp_path, extra)


def test_bpd_decoders_read_the_models_saved_with_the_heads(tiny_pair_dir, data_file, heads_dir, tmp_path):
    """decoding=bpd* with heads=PATH: the n-gram folders are found through ${heads}, the neural rescorer
    loads the pair's drafter through ${model.drafter}; every refined decoder keeps greedy output."""
    decoders = ["bpd_0gram", "bpd_2gram", "bpd", "bpd_neural"]
    results = _run_eval_main(
        tiny_pair_dir,
        data_file,
        tmp_path,
        [
            f"heads={heads_dir}",
            f"eval.decoders=[{','.join(decoders)}]",
            "eval.temperatures=[0.0]",
            "eval.plots=false",
        ],
    )
    assert [r["decoder"] for r in results["runs"]] == decoders
    assert all(r["greedy_match"] for r in results["runs"])


def test_sync_and_async_decoders_in_one_table(tiny_pair_dir, data_file, tmp_path):
    """eval.decoders=[sd,async]: both run the same drafter on the same prompts, greedy output checked."""
    results = _run_eval_main(
        tiny_pair_dir,
        data_file,
        tmp_path,
        ["eval.decoders=[sd,async]", "eval.temperatures=[0.0,1.0]", "eval.plots=false"],
    )
    assert sorted((r["decoder"], r["temperature"]) for r in results["runs"]) == [
        ("async", 0.0),
        ("async", 1.0),
        ("sd", 0.0),
        ("sd", 1.0),
    ]
    assert all(r["greedy_match"] for r in results["runs"] if r["temperature"] == 0.0)
    assert all("overlap_fraction" in r["metrics"] for r in results["runs"])


def test_steered_decoding_of_an_exported_steering_module(tiny_pair_dir, data_file, tmp_path):
    """decoding=steered steering=PATH: the module is loaded through ${steering}; greedy output kept;
    without steering=PATH the run stops at start-up naming the key."""
    from train.models.steering_module import SteeringModule

    verifier = AutoModelForCausalLM.from_pretrained(tiny_pair_dir / "verifier")
    drafter = AutoModelForCausalLM.from_pretrained(tiny_pair_dir / "drafter")
    SteeringModule.for_pair(verifier, drafter).save_pretrained(tmp_path / "steering")
    results = _run_eval_main(
        tiny_pair_dir,
        data_file,
        tmp_path,
        [
            f"steering={tmp_path / 'steering'}",
            "eval.decoders=[sd,steered]",
            "eval.temperatures=[0.0]",
            "eval.plots=false",
        ],
    )
    assert [r["decoder"] for r in results["runs"]] == ["sd", "steered"]
    assert all(r["greedy_match"] for r in results["runs"])
    with pytest.raises(ConfigError, match="pass steering=PATH"):
        _run_eval_main(tiny_pair_dir, data_file, tmp_path, ["decoding=steered"])
