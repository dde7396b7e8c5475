"""Lightning's FSDP strategy for real, on two CPU processes (gloo; :class:`tests.fsdp.CPUFSDPStrategy`):
a method trains two steps under ``bf16-mixed`` with gradient clipping (what ``trainer=fsdp`` sets), its
trainable weights sharded, and every norm it clips by is the norm of the whole, unsharded gradients."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.multiprocessing as mp
from datasets import Dataset
from safetensors.torch import load_file

from tests.conftest import make_tokenizer, tiny_llama
from tests.fsdp import CPUFSDPStrategy, gloo_rank
from train.data.datamodule import PromptDataModule
from train.methods.distillspec.config import DistillSpecConfig
from train.methods.distillspec.module import DistillSpecModule
from train.methods.eagle3.build import eagle3_drafter
from train.methods.eagle3.config import Eagle3Config
from train.methods.eagle3.module import Eagle3Module
from train.methods.steering.build import steering_for
from train.methods.steering.config import DISTILLED_ARM, MAIN_ARM, SteeringConfig
from train.methods.steering.module import SteeringTrainingModule
from train.models.answers import Answer
from train.models.draft_vocab import set_draft_vocab
from train.training.answer_data import AnswerDataModule
from train.training.optim import grad_norm
from train.training.trainer import full_weights_on_rank_zero

CLIP = 1e-3  # tight enough to bite on every step
PROMPTS = dict(max_new_tokens=6, prompt_len=8, batch_size=2, num_prompts=8, num_val_prompts=4)
ADAMW = functools.partial(torch.optim.AdamW, lr=1e-3)


def _data(cfg) -> PromptDataModule:
    docs = [f"def add(a, b):\n    return a + b  # doc {i} " + "x" * (i % 5) for i in range(16)]
    splits = {
        "train": Dataset.from_dict({"text": docs[:12]}),
        "validation": Dataset.from_dict({"text": docs[12:]}),
    }
    return PromptDataModule(
        splits,
        make_tokenizer(),
        prompt_len=cfg.prompt_len,
        batch_size=cfg.batch_size,
        continuation_len=cfg.max_new_tokens,
        max_prompts=cfg.num_prompts,
        max_val_prompts=cfg.num_val_prompts,
    )


def _distillspec() -> tuple[L.LightningModule, PromptDataModule, list[list[str]]]:
    cfg = DistillSpecConfig(optimizer=ADAMW, data_source="verifier", **PROMPTS)
    drafter, verifier = tiny_llama(hidden=32, seed=1), tiny_llama(hidden=64, seed=0)
    module = DistillSpecModule(drafter.to(torch.bfloat16), verifier.to(torch.bfloat16), make_tokenizer(), cfg)
    return module, _data(cfg), [["drafter."]]  # one global norm


def _distillspec_draft_vocab() -> tuple[L.LightningModule, PromptDataModule, list[list[str]]]:
    """On-policy, the drafter drafting over a reduced vocabulary (its head's rows sliced in the step)."""
    cfg = DistillSpecConfig(optimizer=ADAMW, data_source="drafter", **PROMPTS)
    drafter, verifier = tiny_llama(hidden=32, seed=1), tiny_llama(hidden=64, seed=0)
    set_draft_vocab(drafter, [*range(0, 256, 2), 257])
    module = DistillSpecModule(drafter.to(torch.bfloat16), verifier.to(torch.bfloat16), make_tokenizer(), cfg)
    return module, _data(cfg), [["drafter."]]


def _steering() -> tuple[L.LightningModule, PromptDataModule, list[list[str]]]:
    cfg = SteeringConfig(optimizer=ADAMW, gamma=2, **PROMPTS)
    verifier, drafter = tiny_llama(hidden=64, seed=0).to(torch.bfloat16), tiny_llama(hidden=32, seed=1)
    arms = {
        DISTILLED_ARM: (tiny_llama(hidden=32, seed=2).to(torch.bfloat16), None),
        MAIN_ARM: (drafter.to(torch.bfloat16), steering_for(cfg, verifier, drafter)),
    }
    module = SteeringTrainingModule(verifier, arms, make_tokenizer(), cfg)
    groups = [[f"drafters.{DISTILLED_ARM}."], [f"drafters.{MAIN_ARM}.", f"steering.{MAIN_ARM}."]]  # per arm
    return module, _data(cfg), groups


def _answers() -> dict[str, list[Answer]]:
    """Small hand-made answers for the drafters on the verifier's states."""

    def answer(i: int) -> Answer:
        tokens = [40 + (i + j) % 20 for j in range(5 + i % 3)] + [257]
        return Answer(
            [256, 10 + i, 11 + i, 12], tokens, torch.zeros(len(tokens), 1), torch.zeros(len(tokens), 1)
        )

    return {"train": [answer(i) for i in range(8)], "validation": [answer(i) for i in range(8, 10)]}


def _eagle3() -> tuple[L.LightningModule, AnswerDataModule, list[list[str]]]:
    """The EAGLE-3 drafter (float32, its frozen embedding included) beside a frozen bfloat16 verifier that
    stays outside the module, over a reduced draft vocabulary, on small hand-made answers."""
    cfg = Eagle3Config(
        optimizer=ADAMW, ttt_steps=2, max_len=24, batch_size=2, draft_vocab_size=32, aux_layers=[0, 1, 1]
    )
    verifier, tok, answers = tiny_llama(hidden=64, seed=0).to(torch.bfloat16), make_tokenizer(), _answers()
    module = Eagle3Module(verifier, eagle3_drafter(cfg, verifier, tok, answers["train"]), cfg, tok)
    return module, AnswerDataModule(answers, 258, cfg.batch_size, cfg.max_len), [["drafter."]]


def _dflash() -> tuple[L.LightningModule, AnswerDataModule, list[list[str]]]:
    """The DFlash drafter (two layers, float32) on the same frozen bfloat16 verifier and answers as
    EAGLE-3's."""
    from train.methods.dflash.build import dflash_drafter
    from train.methods.dflash.config import DFlashConfig
    from train.methods.dflash.module import DFlashModule

    eagle3, data, prefixes = _eagle3()
    cfg = DFlashConfig(
        optimizer=ADAMW,
        num_layers=2,
        block_size=4,
        num_anchors=4,
        max_len=24,
        batch_size=2,
        draft_vocab_size=32,
        aux_layers=[0, 1, 1],
        compare_eagle3=None,
    )
    verifier, tok = eagle3.verifier, eagle3.tokenizer
    drafter = dflash_drafter(cfg, verifier, tok, _answers()["train"])
    return DFlashModule(verifier, drafter, cfg, tok), data, prefixes


METHODS = {
    "dflash": _dflash,
    "distillspec": _distillspec,
    "distillspec_draft_vocab": _distillspec_draft_vocab,
    "steering": _steering,
    "eagle3": _eagle3,
}


def _checksums(tensors: dict[str, torch.Tensor]) -> list[float]:
    """Each tensor's element count and sum, in name order (float32)."""
    return [x for _, t in sorted(tensors.items()) for x in (float(t.numel()), float(t.float().sum()))]


def _worker(rank: int, out: str, method: str) -> None:
    with gloo_rank(rank, 2, out):
        _train(rank, out, method)


def _train(rank: int, out: str, method: str) -> None:
    module, data, prefixes = METHODS[method]()
    named = dict(module.named_parameters())
    groups = [[p for n, p in named.items() if n.startswith(tuple(pre))] for pre in prefixes]
    full_sizes = [sum(p.numel() for p in g) for g in groups]
    norms: list[list[list[float]]] = []
    clip = module.configure_gradient_clipping

    def recorded(optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        shards = module.trainer.strategy.model.process_group  # type: ignore[union-attr]
        before = [float(grad_norm(g, shards)) for g in groups]
        clip(optimizer, gradient_clip_val, gradient_clip_algorithm)
        norms.append([before, [float(grad_norm(g, shards)) for g in groups]])

    module.configure_gradient_clipping = recorded  # type: ignore[method-assign]
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=CPUFSDPStrategy(),
        precision="bf16-mixed",
        max_steps=2,
        gradient_clip_val=CLIP,
        limit_val_batches=0,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        default_root_dir=out,
    )
    trainer.fit(module, datamodule=data)
    exported: dict[str, list[float]] = {}
    with full_weights_on_rank_zero(trainer):  # as the finish step: every rank enters, rank 0 exports
        if rank == 0:
            folder = Path(module.export(str(Path(out) / "export" / module.artifact_dir)))
            exported = {
                str(f.relative_to(folder.parent)): _checksums(load_file(f))
                for f in sorted(folder.parent.rglob("*.safetensors"))
            }
            if method == "steering":  # the gathered steering module, to compare with what was saved
                exported["gathered"] = _checksums(module.steering_of(MAIN_ARM).state_dict())
    result = {
        "exported": exported,
        "steps": trainer.global_step,
        "norms": norms,
        "full_sizes": full_sizes,
        "local_sizes": [sum(p.numel() for p in g) for g in groups],
        "dtypes": sorted({str(p.dtype) for g in groups for p in g}),
    }
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(result))


@pytest.mark.slow
@pytest.mark.parametrize("method", list(METHODS))
def test_two_steps_under_lightning_fsdp_clip_by_the_whole_gradient_norm(method, tmp_path):
    mp.spawn(_worker, args=(str(tmp_path), method), nprocs=2)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["steps"] for r in ranks] == [2, 2]
    for r in ranks:
        assert r["dtypes"] == ["torch.float32"]  # float32 master weights, sharded
        assert 0 < sum(r["local_sizes"]) < sum(r["full_sizes"])  # a shard (an arm may lie on one rank only)
    assert [a + b for a, b in zip(ranks[0]["local_sizes"], ranks[1]["local_sizes"], strict=True)] == ranks[0][
        "full_sizes"
    ]
    assert ranks[0]["norms"] == ranks[1]["norms"] and len(ranks[0]["norms"]) == 2  # one global value per step
    for before, after in ranks[0]["norms"]:
        for b, a in zip(before, after, strict=True):
            assert b > CLIP and a == pytest.approx(CLIP, rel=1e-3)  # each group clipped to exactly CLIP
    # the finish step's export under FSDP (gathered on rank 0): full weights, saved and loadable
    exported = ranks[0]["exported"]
    assert exported and not ranks[1]["exported"]
    if method == "steering":  # saved from views into FSDP's flat parameter (failed so on an H200)
        assert exported["steering/model.safetensors"] == pytest.approx(exported["gathered"])
