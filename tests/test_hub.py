"""The Hub push of every export kind (issue 43, item 4): each is verified by its own loader, an existing
public repository pushed with ``private=True`` is said, a new ``hub.revision`` branch is created, each kind
gets the model card that fits it. ``huggingface_hub.HfApi`` is replaced by a recorder: nothing reaches the
network."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import huggingface_hub
import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file

from tests.conftest import tiny_llama
from train.export.hub import export_kind, push_to_hub
from train.export.medusa_layout import export_vllm_medusa, load_vllm_medusa
from train.export.model_card import write_model_card
from train.export.speculators import export_speculators, load_speculators
from train.models.eagle3_drafter import Eagle3Drafter
from train.models.heads import MedusaHeads
from train.models.loading import CorruptModelError

pytestmark = pytest.mark.usefixtures("one_thread")


def _card(folder: Path) -> Path:
    (folder / "README.md").write_text("---\nlicense: apache-2.0\n---\n# an export\n")
    return folder


@pytest.fixture(scope="module")
def exports(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One folder of each kind the project pushes but the causal LM (covered in tests/test_export.py)."""
    root = tmp_path_factory.mktemp("exports")
    verifier = tiny_llama(hidden=32, layers=4)
    drafter = Eagle3Drafter.from_verifier(verifier, draft_ids=list(range(0, 260, 2)))
    drafter.save_pretrained(root / "eagle3")
    export_speculators(drafter, root / "eagle3_speculators", "org/verifier")
    heads = MedusaHeads(hidden_size=32, vocab_size=260, num_heads=2, draft_vocab=list(range(0, 260, 4)))
    heads.save_pretrained(root / "heads")
    export_vllm_medusa(heads, root / "heads_vllm")
    return {kind: _card(root / kind) for kind in ("eagle3", "eagle3_speculators", "heads", "heads_vllm")}


@pytest.mark.parametrize("kind", ["eagle3", "eagle3_speculators", "heads", "heads_vllm"])
def test_a_dry_run_accepts_every_export_kind(kind: str, exports: dict[str, Path], monkeypatch) -> None:
    monkeypatch.delenv("HF_TOKEN", raising=False)
    assert export_kind(exports[kind]) == kind
    report = push_to_hub(exports[kind], "me/x", dry_run=True)
    assert "model.safetensors" in report["files"]


def test_the_layout_loaders_give_back_the_exported_weights(exports: dict[str, Path]) -> None:
    drafter = Eagle3Drafter.from_pretrained(str(exports["eagle3"]))
    for name, tensor in load_speculators(exports["eagle3_speculators"]).state_dict().items():
        assert torch.equal(tensor, drafter.state_dict()[name]), name
    heads = MedusaHeads.from_pretrained(str(exports["heads"]))
    loaded = load_vllm_medusa(exports["heads_vllm"])
    assert loaded.draft_vocab == heads.draft_vocab
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, heads.state_dict()[name]), name


@pytest.mark.parametrize("kind", ["eagle3", "eagle3_speculators", "heads", "heads_vllm"])
def test_a_folder_its_loader_refuses_is_not_pushed(kind: str, exports: dict[str, Path], tmp_path) -> None:
    folder = tmp_path / kind
    folder.mkdir()
    for f in exports[kind].iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    tensors = load_file(str(folder / "model.safetensors"))
    tensors.pop(sorted(tensors)[0])  # a tensor lost: the file still parses
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(CorruptModelError, match=f"kind {kind}"):
        push_to_hub(folder, "me/x", dry_run=True)


class RecordingApi:
    """Stands in for ``HfApi``: a repository that exists (public unless ``private``) and a record of calls."""

    instances: list[RecordingApi] = []

    def __init__(self, token: str | None = None, exists: bool = True, private: bool = False) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.exists, self.private = exists, private
        RecordingApi.instances.append(self)

    def repo_exists(self, repo_id: str, **kwargs: Any) -> bool:
        return self.exists

    def repo_info(self, repo_id: str, **kwargs: Any) -> Any:
        return SimpleNamespace(private=self.private)

    def __getattr__(self, name: str) -> Any:
        def record(*args: Any, **kwargs: Any) -> Any:
            self.calls.append((name, {"args": args, **kwargs}))
            return SimpleNamespace(commit_url=f"https://huggingface.co/me/x/commit/{name}")

        return record


def _push(monkeypatch, folder: Path, api: type, **kwargs: Any) -> tuple[dict[str, Any], RecordingApi]:
    monkeypatch.setenv("HF_TOKEN", "hf_test")
    monkeypatch.setattr(huggingface_hub, "HfApi", api)
    RecordingApi.instances.clear()
    report = push_to_hub(folder, "me/x", **kwargs)
    return report, RecordingApi.instances[-1]


def test_an_existing_public_repo_pushed_as_private_is_said(exports, monkeypatch, caplog) -> None:
    with caplog.at_level("WARNING"):
        report, _ = _push(monkeypatch, exports["heads"], RecordingApi, private=True)
    assert any("already exists and is PUBLIC" in w for w in report["warnings"])
    assert "already exists and is PUBLIC" in caplog.text

    class PrivateRepo(RecordingApi):
        def __init__(self, token: str | None = None) -> None:
            super().__init__(token, exists=True, private=True)

    report, _ = _push(monkeypatch, exports["heads"], PrivateRepo, private=True)
    assert report["warnings"] == []


def test_a_new_revision_branch_is_created_before_the_upload(exports, monkeypatch) -> None:
    _, api = _push(monkeypatch, exports["eagle3"], RecordingApi, revision="v2")
    names = [name for name, _ in api.calls]
    assert names.index("create_branch") < names.index("upload_folder")
    branch = dict(api.calls)["create_branch"]
    assert branch["branch"] == "v2" and branch["exist_ok"] is True
    assert dict(api.calls)["upload_folder"]["revision"] == "v2"
    _, api = _push(monkeypatch, exports["eagle3"], RecordingApi)
    assert "create_branch" not in [name for name, _ in api.calls]  # no revision: the main branch


def _copy(source: Path, folder: Path) -> Path:
    folder.mkdir(parents=True)
    for f in source.iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    return folder


RUN_CONFIG = {"name": "run", "license": "mit", "model": {"verifier": "org/verifier", "drafter": "org/d"}}
USAGE = {
    "eagle3": "python scripts/evaluate.py decoding=eagle3 eagle3=",
    "eagle3_speculators": "vllm serve ./eagle3_speculators\n",
    "heads": "python scripts/evaluate.py decoding=medusa heads=",
    "heads_vllm": '"method": "medusa", "num_speculative_tokens": 2}',
}


@pytest.mark.parametrize("kind", ["eagle3", "eagle3_speculators", "heads", "heads_vllm"])
def test_each_export_kind_gets_the_card_that_fits_it(kind: str, exports: dict[str, Path], tmp_path) -> None:
    """No ``AutoModelForCausalLM`` snippet where transformers cannot load the folder; the usage that
    fits it; the license front matter on every kind, the vLLM layouts included."""
    folder = _copy(exports[kind], tmp_path / kind)
    card = write_model_card(folder, config=RUN_CONFIG).read_text()
    front = yaml.safe_load(card.split("---\n")[1])
    assert card.startswith("---\n") and front["license"] == "mit" and "library_name" not in front
    assert "AutoModelForCausalLM" not in card and "assistant_model" not in card
    assert USAGE[kind] in card


def test_the_serving_copy_beside_an_export_gets_its_card_from_the_same_config(exports, tmp_path) -> None:
    for kind, serving in (("eagle3", "eagle3_speculators"), ("heads", "heads_vllm")):
        _copy(exports[serving], tmp_path / serving)
        (tmp_path / serving / "README.md").unlink()
        write_model_card(_copy(exports[kind], tmp_path / kind), config=RUN_CONFIG)
        card = (tmp_path / serving / "README.md").read_text()
        assert yaml.safe_load(card.split("---\n")[1])["license"] == "mit" and USAGE[serving] in card
