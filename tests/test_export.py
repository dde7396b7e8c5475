"""Export: a Hugging Face folder with a model card, usable as ``assistant_model``; Hub push dry runs."""

from __future__ import annotations

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.conftest import make_tokenizer, tiny_llama
from train.config import ConfigError
from train.evaluation import EvalConfig, evaluate_drafters
from train.export.drafter import drafter_folder, export_drafter
from train.export.hub import HubConfig, push_to_hub
from train.export.model_card import model_card, write_model_card

CONFIG = {
    "name": "distillspec",
    "model": {"verifier": "checkpoints/tiny/verifier", "drafter": "checkpoints/tiny/drafter"},
    "method": {"divergence": "fkl", "lmbda": 1.0},
    "hub": {"repo_id": "me/x", "token": "hf_SECRET123"},
    "logger": {"wandb_api_key": "SECRET456"},
}


@pytest.fixture(scope="module")
def pair():
    return tiny_llama(hidden=64, seed=0), tiny_llama(hidden=32, seed=1), make_tokenizer()


@pytest.fixture(scope="module")
def results(pair):
    verifier, drafter, _ = pair
    prompts = [torch.tensor([[256, 10, 20, 30]])]
    cfg = EvalConfig(temperatures=[0.0], seeds=[0], max_new_tokens=6, progress=False, warmup=False)
    return evaluate_drafters(verifier, {"after": drafter}, prompts, cfg)


@pytest.fixture(scope="module")
def exported(pair, results, tmp_path_factory):
    _, drafter, tok = pair
    out = tmp_path_factory.mktemp("run") / "drafter"
    return export_drafter(
        drafter,
        tok,
        out,
        config=CONFIG,
        results=results,
        base_model="org/base-drafter",
        verifier="org/verifier",
    )


def test_export_round_trip(pair, exported):
    _, drafter, _ = pair
    files = {p.name for p in exported.iterdir()}
    assert {"config.json", "model.safetensors", "README.md", "tokenizer.json", "eval_results.json"} <= files
    loaded = AutoModelForCausalLM.from_pretrained(exported)
    for (name, a), b in zip(drafter.state_dict().items(), loaded.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    assert AutoTokenizer.from_pretrained(exported).eos_token == "<|eos|>"


def test_card_front_matter_table_and_config(exported):
    card = (exported / "README.md").read_text()
    front = yaml.safe_load(card.split("---\n")[1])
    assert front["library_name"] == "transformers"
    assert {"speculative-decoding", "draftsmith"} <= set(front["tags"])
    assert front["base_model"] == "org/base-drafter"
    assert card.startswith("---\n") and "# distillspec drafter" in card
    assert "| after | sd | 4 | 0 |" in card  # the evaluation table (drafter, decoder, gamma, T)
    assert "assistant_model=drafter" in card and 'from_pretrained("org/verifier")' in card
    config_block = card.split("```yaml\n")[1].split("```")[0]
    assert yaml.safe_load(config_block)["method"] == {"divergence": "fkl", "lmbda": 1.0}
    assert "SECRET" not in card
    config = yaml.safe_load(config_block)
    assert config["hub"]["token"] == "<redacted>" and config["logger"]["wandb_api_key"] == "<redacted>"


def test_card_variants():
    # before/after per temperature (what a run's report holds) and a local base model kept out of front matter
    evaluation = {
        "before": {"0": {"block_efficiency": {"mean": 2.0, "std": 0.1, "n": 2}}},
        "after": {"0": {"block_efficiency": {"mean": 2.5, "std": 0.1, "n": 2}}},
    }
    card = model_card("d", results=evaluation, base_model="checkpoints/tiny/drafter")
    assert "| after | 0 | n/a | n/a | 2.50 ± 0.10 |" in card
    assert "base_model:" not in card.split("---")[1]
    assert "No evaluation was attached" in model_card("d")
    assert "| my | table |" in model_card("d", results="| my | table |")


def test_exported_drafter_is_a_hf_assistant_model(pair, exported):
    verifier, _, _ = pair
    drafter = AutoModelForCausalLM.from_pretrained(exported)
    ids = torch.tensor([[256, 40, 41, 42, 43]])
    plain = verifier.generate(ids, max_new_tokens=10, do_sample=False, pad_token_id=258)
    assisted = verifier.generate(
        ids, max_new_tokens=10, do_sample=False, assistant_model=drafter, pad_token_id=258
    )
    assert torch.equal(plain, assisted)


def test_export_accepts_the_distillspec_call(pair, tmp_path):
    _, drafter, tok = pair
    out = export_drafter(drafter, tok, tmp_path / "drafter", results={}, config=CONFIG)
    card = (out / "README.md").read_text()
    assert "No evaluation was attached" in card and "checkpoints/tiny/verifier" in card


def test_card_is_refreshed_without_touching_the_weights(pair, results, tmp_path):
    """The finish step writes the card at export time and again once the evaluation is done."""
    _, drafter, tok = pair
    out = export_drafter(drafter, tok, tmp_path / "drafter", config=CONFIG)
    weights = (out / "model.safetensors").read_bytes()
    assert "No evaluation was attached" in (out / "README.md").read_text()
    write_model_card(out, config=CONFIG, results=results)
    card = (out / "README.md").read_text()
    assert (
        "No evaluation was attached" not in card and "| after |" in card and "# distillspec drafter" in card
    )
    assert (out / "eval_results.json").is_file() and (out / "model.safetensors").read_bytes() == weights


def test_push_dry_run_lists_files_without_network(exported, monkeypatch):
    monkeypatch.delenv("HF_TOKEN", raising=False)
    report = push_to_hub(exported, "me/my-drafter", dry_run=True)
    assert report["dry_run"] and "model.safetensors" in report["files"] and "README.md" in report["files"]
    with pytest.raises(ConfigError, match="HF_TOKEN"):
        push_to_hub(exported, "me/my-drafter")  # fails before any network call


def test_push_rejects_bad_folders_and_ids(tmp_path, exported):
    with pytest.raises(ConfigError, match="hub.repo_id"):
        push_to_hub(exported, "not a repo id", dry_run=True)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no safetensors"):
        push_to_hub(tmp_path / "empty", "me/x", dry_run=True)
    with pytest.raises(ConfigError, match="hub.repo_id"):
        HubConfig(repo_id="me/x/y")
    with pytest.raises(ConfigError, match="no drafter/ folder"):
        drafter_folder(tmp_path / "empty")
    assert drafter_folder(exported.parent) == exported


WANDB_KEY = "0123456789abcdef0123456789abcdef01234567"


def test_secrets_are_filtered_by_exact_key_and_by_value_settings_survive(monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "my-own-token-value")
    config = {
        "name": "run",
        "method": {"max_new_tokens": 32, "pad_token_id": 0, "num_tokens": 5},
        "notes": {
            "anything": "hf_abcdefghijklmnopqrstuvwxyz123456",
            "other": WANDB_KEY,
            "env": "my-own-token-value",
        },
        "hub": {"revision": "0123456789abcdef0123456789abcdef01234567", "access_token": "x"},
    }
    config_block = model_card("d", config=config).split("```yaml\n")[1].split("```")[0]
    kept = yaml.safe_load(config_block)
    assert kept["method"] == {"max_new_tokens": 32, "pad_token_id": 0, "num_tokens": 5}
    assert set(kept["notes"].values()) == {"<redacted>"}  # an hf_ token, a W&B key, $HF_TOKEN's value
    assert kept["hub"]["access_token"] == "<redacted>"
    assert kept["hub"]["revision"] == WANDB_KEY  # a commit hash under a revision key is not a secret


def test_card_has_a_license_names_local_models_plainly_and_no_absolute_path(pair, results, tmp_path):
    _, drafter, tok = pair
    root = tmp_path / "project"
    run_dir = root / "checkpoints" / "distillspec" / "2026-01-01_00-00-00"
    config = {
        "name": "distillspec",
        "paths": {
            "root_dir": str(root),
            "run_dir": str(run_dir),
            "tiny_dir": str(root / "checkpoints" / "tiny"),
        },
        "model": {
            "verifier": str(root / "checkpoints/tiny/verifier"),
            "drafter": str(root / "checkpoints/tiny/drafter"),
        },
        "callbacks": {"model_checkpoint": {"dirpath": str(run_dir / "checkpoints")}},
        "data": {"corpus_dir": "/usr/lib/python3.11"},
        "license": "mit",
    }
    out = export_drafter(drafter, tok, run_dir / "drafter", config=config, results=results)
    card = (out / "README.md").read_text()
    front = yaml.safe_load(card.split("---\n")[1])
    assert front["license"] == "mit" and "base_model" not in front
    assert (
        "- verifier (target): local folder `checkpoints/tiny/verifier` "
        "(not on the Hub; draftsmith's embedded tiny pair" in card
    )
    assert 'from_pretrained("PATH_TO_THE_VERIFIER")' in card
    for name in ("README.md", "eval_results.json", "config.json", "tokenizer_config.json"):
        text = (out / name).read_text()
        assert str(tmp_path) not in text and "/usr/lib" not in text, name
    config_block = yaml.safe_load(card.split("```yaml\n")[1].split("```")[0])
    assert (
        config_block["paths"]["run_dir"] == "."
        and config_block["data"]["corpus_dir"] == "<local>/lib/python3.11"
    )
    assert config_block["callbacks"]["model_checkpoint"]["dirpath"] == "./checkpoints"
    assert yaml.safe_load(model_card("d").split("---\n")[1])["license"] == "apache-2.0"  # the default


def test_dry_run_loads_what_it_would_push_and_rejects_a_corrupt_file(pair, tmp_path, monkeypatch):
    from train.models.loading import CorruptModelError

    monkeypatch.delenv("HF_TOKEN", raising=False)
    _, drafter, tok = pair
    out = export_drafter(drafter, tok, tmp_path / "drafter", config=CONFIG)
    assert push_to_hub(out, "me/x", dry_run=True)["files"]
    weights = out / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])  # truncated: an interrupted copy
    with pytest.raises(CorruptModelError, match=rf"{weights} is truncated or corrupt"):
        push_to_hub(out, "me/x", dry_run=True)
    with pytest.raises(CorruptModelError, match=str(weights)):
        push_to_hub(out, "me/x")  # a real push checks first, before the token or the network


def test_export_script_dry_run_names_a_corrupt_file_in_one_line(pair, tmp_path):
    import subprocess
    import sys

    from tests.conftest import REPO_ROOT

    _, drafter, tok = pair
    out = export_drafter(drafter, tok, tmp_path / "run" / "drafter", config=CONFIG)
    (out / "model.safetensors").write_bytes(b"not safetensors")
    proc = subprocess.run(
        [
            sys.executable,
            "scripts/export.py",
            f"run={tmp_path / 'run'}",
            "hub.repo_id=me/x",
            "hub.dry_run=true",
            f"hydra.run.dir={tmp_path / 'hydra'}",
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1, proc.stderr[-2000:]
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith(f"error: {out / 'model.safetensors'} is truncated or corrupt")
