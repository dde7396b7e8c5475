"""DistillSpec on a drafter with a draft vocabulary (``config.draft_vocab``): the loss is the divergence
over the draft ids with the verifier renormalised there (checked against a hand computation from the
plain drafter's logits), gradients are finite, on-policy rollouts sample inside the draft vocabulary,
``expected_acceptance`` is what decoding sees, and LoRA / export still handle the plain model."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.conftest import make_tokenizer, tiny_llama
from tests.methods.test_distillspec import _cfg, _fixed_batch, _module
from train.data.datamodule import PromptDataModule
from train.methods.distillspec.module import DistillSpecModule
from train.models.draft_vocab import DraftVocabModel, draft_vocab_of, set_draft_vocab
from train.training.answer_cache import continuation_logits

pytestmark = pytest.mark.usefixtures("one_thread")

DRAFT_IDS = list(range(0, 256, 2)) + [257]  # even byte ids and the EOS (tests/conftest.py's tokenizer)


def _draft_module(**kw) -> tuple[DistillSpecModule, PromptDataModule]:
    """test_distillspec.py's pair and data, the drafter drafting over DRAFT_IDS."""
    _, data = _module(_cfg(data_source=kw.get("data_source", "fixed")))
    drafter, verifier = tiny_llama(hidden=32, seed=1), tiny_llama(hidden=64, seed=0)
    drafter.train()
    set_draft_vocab(drafter, DRAFT_IDS)
    module = DistillSpecModule(drafter, verifier, make_tokenizer(), _cfg(**kw), seed=0)
    assert module.draft_ids is not None and module.draft_ids.tolist() == DRAFT_IDS
    return module, data


@pytest.mark.parametrize("div", ["fkl", "jsd", "tvd"])
def test_the_loss_is_the_divergence_over_the_draft_ids_and_trains(div):
    module, data = _draft_module(data_source="fixed", divergence=div, beta=0.3, temperature=0.8)
    ro = module._fixed(_fixed_batch(module, data))
    loss, d_logits, v_logits, mask = module.distill_loss(ro)
    assert d_logits.shape == (*mask.shape, len(DRAFT_IDS)) and torch.isfinite(loss)
    with torch.no_grad():  # by hand, from the plain drafter's full logits
        ids = torch.tensor(DRAFT_IDS)
        q = torch.softmax(continuation_logits(module.drafter, ro)[..., ids].double() / 0.8, -1)
        p = torch.softmax(v_logits.double() / 0.8, -1)[..., ids]
        p = p / p.sum(-1, keepdim=True)
        if div == "fkl":
            per = (p * (p / q).log()).sum(-1)
        elif div == "tvd":
            per = 0.5 * (p - q).abs().sum(-1)
        else:
            m = 0.3 * p + 0.7 * q
            per = 0.3 * (p * (p / m).log()).sum(-1) + 0.7 * (q * (q / m).log()).sum(-1)
    torch.testing.assert_close(loss.double(), per[mask].mean(), atol=1e-5, rtol=1e-4)
    loss.backward()
    grads = [p.grad for p in module.drafter.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)
    head = module.drafter.get_output_embeddings().weight.grad  # an untied head: only its draft rows train
    outside = torch.ones(head.shape[0], dtype=torch.bool)
    outside[DRAFT_IDS] = False
    assert head[DRAFT_IDS].abs().sum() > 0 and not head[outside].any()


def test_expected_acceptance_counts_the_teachers_mass_outside_as_rejected():
    module, data = _draft_module(data_source="fixed")
    ro = module._fixed(_fixed_batch(module, data))
    with torch.no_grad():
        _, d_logits, v_logits, mask = module.distill_loss(ro)
        ea = module.acceptance(d_logits, v_logits, mask)
        ids = torch.tensor(DRAFT_IDS)
        p = torch.softmax(v_logits.double(), -1)
        q = torch.zeros_like(p)
        q[..., ids] = torch.softmax(d_logits.double(), -1)
    torch.testing.assert_close(ea.double(), torch.minimum(p, q).sum(-1)[mask].mean(), atol=1e-6, rtol=1e-5)


def test_on_policy_rollouts_sample_inside_the_draft_vocabulary():
    module, data = _draft_module(data_source="drafter", max_new_tokens=12)
    batch = _fixed_batch(module, data)
    ro = module.make_batch(batch, "drafter", module._generator(0, 0))
    drafted = ro.sequences[ro.continuation_mask]
    assert drafted.numel() > 0 and set(drafted.tolist()) <= set(DRAFT_IDS)
    module.training_step(batch, 0).backward()  # the whole step, on-policy


def test_the_ground_truth_ce_counts_the_labels_inside_the_draft_vocabulary():
    module, data = _draft_module(data_source="fixed", ce_weight=0.5)
    batch = _fixed_batch(module, data)
    ce = module.ground_truth_ce(batch)
    assert torch.isfinite(ce) and float(ce) > 0
    total = module.training_step(batch, 0)
    assert torch.isfinite(total)


def test_lora_and_export_handle_the_plain_model(tmp_path):
    module, data = _draft_module(data_source="fixed", lora={"enabled": True, "r": 4, "alpha": 8})
    batch = _fixed_batch(module, data)
    loss = module.training_step(batch, 0)
    loss.backward()
    grads = {n: p.grad for n, p in module.drafter.named_parameters() if p.grad is not None}
    assert grads and all("lora_" in n and torch.isfinite(g).all() for n, g in grads.items())
    assert any(g.abs().sum() > 0 for g in grads.values())  # the wrapper runs the adapted decoder
    merged = module.distilled_drafter()
    assert type(merged).__name__ == "LlamaForCausalLM" and draft_vocab_of(merged) == DRAFT_IDS
    out = module.export(str(tmp_path / "drafter"))
    reloaded = AutoModelForCausalLM.from_pretrained(out)
    assert type(reloaded).__name__ == "LlamaForCausalLM" and draft_vocab_of(reloaded) == DRAFT_IDS
    assert not isinstance(module.drafter, DraftVocabModel)
