"""EAGLE-3's drafter: building from a verifier, the draft-vocabulary maps, save / load, the KV cache,
the training-time test against a slow sequential reference, the speculators export and its layer
numbering, with broken-on-purpose checks that each of those tests bites."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

import train.export.speculators as speculators_module
import train.models.eagle3_drafter as eagle3_module
import train.models.eagle3_ttt as ttt_module
from tests.models.speculators_reference import load_speculators, read_config
from train.export.speculators import export_speculators
from train.models.draft_vocab import frequent_tokens
from train.models.eagle3_drafter import Eagle3Drafter, default_aux_layers, draft_ids_of, draft_vocab_maps
from train.models.eagle3_ttt import step_loss, ttt_loss, ttt_unroll

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one thread (tests/conftest.py)

VOCAB = 97
DRAFT_IDS = [0, 1, 2, 3, 5, 8, 13, 21, 34, 40, 41, 42, 55, 60, 70, 89, 96]


def llama_verifier(layers: int = 6, seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        rope_parameters={"rope_type": "default", "rope_theta": 5000.0},
    )
    return LlamaForCausalLM(config).eval()


def qwen3_verifier(seed: int = 0) -> Qwen3ForCausalLM:
    torch.manual_seed(seed)
    config = Qwen3Config(
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,  # not hidden / heads
        vocab_size=VOCAB,
        tie_word_embeddings=True,
    )
    return Qwen3ForCausalLM(config).eval()


def randomized(drafter: Eagle3Drafter, seed: int = 1) -> Eagle3Drafter:
    """The drafter with every trainable weight (norms included) perturbed, so no test passes on an
    identity norm or a zero-initialised block."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if name != "embed_tokens.weight":
                p.add_(0.3 * torch.randn(p.shape, generator=gen))
    return drafter


def features_of(verifier, drafter: Eagle3Drafter, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(aux states (B, T, 3h), verifier logits (B, T, V))."""
    with torch.no_grad():
        out = verifier(ids, output_hidden_states=True)
    return torch.cat(drafter.aux_features(out.hidden_states), dim=-1), out.logits


def layer_inputs(verifier, ids: torch.Tensor, layers: list[int]) -> list[torch.Tensor]:
    """The residual stream entering each of ``layers``, captured as vLLM does (before the layer runs)."""
    seen: dict[int, torch.Tensor] = {}
    hooks = []
    for i in layers:

        def grab(module, args, kwargs, i=i):
            seen[i] = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]

        hooks.append(verifier.model.layers[i].register_forward_pre_hook(grab, with_kwargs=True))
    with torch.no_grad():
        verifier(ids)
    for h in hooks:
        h.remove()
    return [seen[i] for i in layers]


def check_layer_numbering(drafter: Eagle3Drafter, verifier, ids: torch.Tensor, layer_ids: list[int]) -> None:
    """The drafter's features equal the inputs of the verifier's layers ``layer_ids`` (vLLM's capture)."""
    with torch.no_grad():
        hidden_states = verifier(ids, output_hidden_states=True).hidden_states
    for ours, theirs in zip(
        drafter.aux_features(hidden_states), layer_inputs(verifier, ids, layer_ids), strict=True
    ):
        torch.testing.assert_close(ours, theirs)


def check_vocab_maps(drafter: Eagle3Drafter, verifier, ids: list[int]) -> None:
    """d2t, t2d and the head's rows agree with the draft ids and the verifier's vocabulary."""
    assert drafter.d2t.dtype == torch.int64 and drafter.t2d.dtype == torch.bool
    assert drafter.t2d.numel() == verifier.config.vocab_size and drafter.d2t.numel() == len(ids)
    assert draft_ids_of(drafter.d2t).tolist() == ids
    assert drafter.t2d.nonzero().flatten().tolist() == ids
    rows = verifier.get_output_embeddings().weight[draft_ids_of(drafter.d2t).clamp(max=VOCAB - 1)]
    torch.testing.assert_close(drafter.lm_head.weight, rows)


# ------------------------------------------------------------------ building


def test_from_verifier_shapes_and_the_aux_layer_rule():
    verifier = llama_verifier(layers=6)
    drafter = Eagle3Drafter.from_verifier(verifier)
    assert drafter.aux_layers == [2, 6 // 2, 6 - 3] == [2, 3, 3] == default_aux_layers(6)
    assert default_aux_layers(32) == [2, 16, 29]
    assert Eagle3Drafter.from_verifier(llama_verifier(layers=8)).aux_layers == [2, 4, 5]
    h = 32
    attn = drafter.layers[0].self_attn
    assert drafter.fc.weight.shape == (h, 3 * h) and drafter.fc.bias is None
    assert attn.q_proj.weight.shape == (4 * 8, 2 * h) and attn.k_proj.weight.shape == (2 * 8, 2 * h)
    assert attn.v_proj.weight.shape == (2 * 8, 2 * h) and attn.o_proj.weight.shape == (h, 4 * 8)
    assert drafter.layers[0].mlp.up_proj.weight.shape == (48, h)
    assert (
        drafter.lm_head.weight.shape == (VOCAB, h)
        and drafter.d2t.abs().sum() == 0
        and bool(drafter.t2d.all())
    )
    assert drafter.rotary_emb.inv_freq[1].item() == pytest.approx(5000.0 ** (-2 / 8))
    ids = torch.tensor([[4, 9, 1, 7, 3]])
    aux, _ = features_of(verifier, drafter, ids)
    out = drafter(ids, drafter.fuse(aux.split(h, dim=-1)), torch.arange(5)[None])
    assert out.logits.shape == (1, 5, VOCAB) and out.hidden.shape == (1, 5, h)


def test_embeddings_are_the_verifiers_and_frozen():
    verifier = llama_verifier()
    drafter = Eagle3Drafter.from_verifier(verifier, draft_ids=DRAFT_IDS)
    assert not drafter.embed_tokens.weight.requires_grad
    torch.testing.assert_close(drafter.embed_tokens.weight, verifier.get_input_embeddings().weight)
    trainable = {n for n, p in drafter.named_parameters() if p.requires_grad}
    assert (
        "embed_tokens.weight" not in trainable and {"fc.weight", "lm_head.weight", "norm.weight"} <= trainable
    )
    check_vocab_maps(drafter, verifier, DRAFT_IDS)


def test_qwen3_verifier_with_its_own_head_dim():
    verifier = qwen3_verifier()
    drafter = Eagle3Drafter.from_verifier(verifier, draft_vocab_size=len(DRAFT_IDS), draft_ids=DRAFT_IDS)
    assert drafter.layers[0].self_attn.q_proj.weight.shape == (4 * 16, 64)
    check_vocab_maps(drafter, verifier, DRAFT_IDS)  # tied embeddings: the head rows are the embedding's
    ids = torch.tensor([[4, 9, 1, 7]])
    aux, _ = features_of(verifier, drafter, ids)
    assert drafter(ids, drafter.fuse(aux), torch.arange(4)[None]).logits.shape == (1, 4, len(DRAFT_IDS))


def test_draft_vocab_maps_by_hand_from_a_small_corpus():
    corpus = [[5, 5, 2, 9], [9, 5, 2, 7]]  # counts: 5 x3, 2 x2, 9 x2, 7 x1
    ids = frequent_tokens(corpus, 3)
    assert ids == [2, 5, 9]
    d2t, t2d = draft_vocab_maps(ids, 12)
    assert d2t.dtype == torch.int64 and d2t.tolist() == [2, 4, 7]  # 0 + 2, 1 + 4, 2 + 7
    assert t2d.dtype == torch.bool and t2d.nonzero().flatten().tolist() == [2, 5, 9] and t2d.numel() == 12
    assert draft_ids_of(d2t).tolist() == [2, 5, 9]
    for bad in ([5, 2, 9], [2, 2, 9], [2, 5, 12], []):
        with pytest.raises(ValueError):
            draft_vocab_maps(bad, 12)
    with pytest.raises(ValueError, match="draft_ids"):
        Eagle3Drafter.from_verifier(llama_verifier(), draft_vocab_size=10)


def test_a_d2t_off_by_one_is_caught(monkeypatch):
    """Broken on purpose: d2t shifted by one."""
    original = eagle3_module.draft_vocab_maps
    monkeypatch.setattr(
        eagle3_module, "draft_vocab_maps", lambda ids, v: (original(ids, v)[0] + 1, original(ids, v)[1])
    )
    verifier = llama_verifier()
    drafter = Eagle3Drafter.from_verifier(verifier, draft_ids=DRAFT_IDS)
    with pytest.raises(AssertionError):
        check_vocab_maps(drafter, verifier, DRAFT_IDS)


# ------------------------------------------------------------------ save, load, cache


def test_save_pretrained_roundtrip_gives_equal_logits(tmp_path):
    verifier = llama_verifier()
    drafter = randomized(Eagle3Drafter.from_verifier(verifier, draft_ids=DRAFT_IDS))
    drafter.save_pretrained(tmp_path)
    loaded = Eagle3Drafter.from_pretrained(tmp_path)
    assert loaded.aux_layers == drafter.aux_layers and loaded.draft_vocab_size == len(DRAFT_IDS)
    assert torch.equal(loaded.d2t, drafter.d2t) and torch.equal(loaded.t2d, drafter.t2d)
    assert not loaded.embed_tokens.weight.requires_grad
    ids = torch.tensor([[4, 9, 1, 7, 3, 3]])
    feats = torch.randn(1, 6, 32)
    pos = torch.arange(6)[None]
    with torch.no_grad():
        torch.testing.assert_close(
            loaded(ids, feats, pos).logits, drafter(ids, feats, pos).logits, rtol=0, atol=0
        )


def test_cache_gives_the_same_output_as_one_forward():
    drafter = randomized(Eagle3Drafter.from_verifier(llama_verifier(), draft_ids=DRAFT_IDS)).eval()
    torch.manual_seed(3)
    ids, feats = torch.randint(0, VOCAB, (2, 7)), torch.randn(2, 7, 32)
    pos = torch.arange(7).expand(2, 7) + 3
    with torch.no_grad():
        full = drafter(ids, feats, pos)
        first = drafter(ids[:, :6], feats[:, :6], pos[:, :6], use_cache=True)
        assert isinstance(first.past_key_values, DynamicCache)
        last = drafter(ids[:, 6:], feats[:, 6:], pos[:, 6:], past_key_values=first.past_key_values)
        masked = drafter(
            ids, feats, pos, attention_mask=torch.ones(7, 7, dtype=torch.bool).tril()[None, None]
        )
    torch.testing.assert_close(first.logits, full.logits[:, :6], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(last.logits, full.logits[:, 6:], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(last.hidden, full.hidden[:, 6:], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(masked.logits, full.logits, atol=1e-5, rtol=1e-5)
    additive = torch.full((7, 7), float("-inf")).triu(diagonal=1)[None, None]  # the same mask, added
    with torch.no_grad():
        torch.testing.assert_close(drafter(ids, feats, pos, attention_mask=additive).logits, full.logits)
    assert first.past_key_values.get_seq_length() == 7


# ------------------------------------------------------------------ training-time test


def sequential_reference(
    drafter: Eagle3Drafter, features: torch.Tensor, ids: torch.Tensor, steps: int
) -> torch.Tensor:
    """(steps, B, T, N): each position p drafted for real, one query at a time with its own cache:
    a causal prefix over f_0..f_p with tokens t_1..t_{p+1} at positions 0..p, then one entry per depth
    k (token t_{p+1+k}, the previous depth's hidden, position p + k). Tokens past the end are 0."""
    batch, length = ids.shape
    padded = torch.cat([ids, torch.zeros(batch, steps + 1, dtype=ids.dtype)], dim=1)
    out = torch.empty(steps, batch, length, drafter.draft_vocab_size)
    for p in range(length):
        cache = DynamicCache()
        res = drafter(
            padded[:, 1 : p + 2],
            features[:, : p + 1],
            torch.arange(p + 1).expand(batch, -1),
            past_key_values=cache,
        )
        out[0, :, p] = res.logits[:, -1]
        hidden = res.hidden[:, -1:]
        for k in range(1, steps):
            token = padded[:, p + 1 + k : p + 2 + k]
            res = drafter(token, hidden, torch.full((batch, 1), p + k), past_key_values=cache)
            out[k, :, p] = res.logits[:, 0]
            hidden = res.hidden
    return out


def ttt_case(steps: int = 4):
    verifier = llama_verifier(layers=8)
    drafter = randomized(Eagle3Drafter.from_verifier(verifier, draft_ids=DRAFT_IDS)).eval()
    ids = torch.tensor([[3, 41, 5, 8, 13, 2, 40, 21, 1], [0, 34, 55, 60, 70, 89, 96, 42, 5]])
    aux, logits = features_of(verifier, drafter, ids)
    return verifier, drafter, ids, aux, logits


def test_ttt_equals_sequential_drafting_position_by_position():
    _, drafter, ids, aux, _ = ttt_case()
    with torch.no_grad():
        fused = drafter.fuse(aux)
        fast = torch.stack(ttt_unroll(drafter, fused, ids, steps=4))
        slow = sequential_reference(drafter, fused, ids, steps=4)
    torch.testing.assert_close(fast, slow, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("bug", ["no +k on positions", "causal over every step"])
def test_a_broken_ttt_is_caught(monkeypatch, bug):
    """Broken on purpose: step k's RoPE position left at p (SpecForge's lost "+ k"), or step k's queries
    allowed to see every earlier position of steps 1..k (not only the diagonal)."""
    if bug == "no +k on positions":
        monkeypatch.setattr(ttt_module, "step_positions", lambda positions, step: positions)
    else:

        def full(length, step, device=None):  # causal over every step's keys
            return torch.ones(length, length, dtype=torch.bool).tril().repeat(1, step + 1)[None, None]

        monkeypatch.setattr(ttt_module, "ttt_mask", full)
    _, drafter, ids, aux, _ = ttt_case()
    with torch.no_grad():
        fused = drafter.fuse(aux)
        fast = torch.stack(ttt_unroll(drafter, fused, ids, steps=4))
        slow = sequential_reference(drafter, fused, ids, steps=4)
    torch.testing.assert_close(fast[0], slow[0], atol=1e-5, rtol=1e-5)  # step 0 is unaffected
    with pytest.raises(AssertionError):
        torch.testing.assert_close(fast, slow, atol=1e-5, rtol=1e-5)


def test_ttt_losses_and_accuracies_from_the_reference_logits():
    _, drafter, ids, aux, vlogits = ttt_case()
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    result = ttt_loss(drafter, aux, ids, vlogits, mask, steps=4)
    with torch.no_grad():
        slow = sequential_reference(drafter, drafter.fuse(aux), ids, steps=4)
    total = 0.0
    for k in range(4):
        keep = torch.zeros_like(ids, dtype=torch.bool)
        keep[:, : 9 - k - 1] = True
        keep &= torch.roll(mask.bool(), -(k + 1), dims=1)
        loss, acc, kept = step_loss(slow[k], vlogits, keep, drafter.draft_ids, drafter.t2d, k)
        assert result.counts[k] == int(kept.sum()) > 0
        torch.testing.assert_close(result.losses[k].detach(), loss, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(result.accuracies[k], acc)
        total += 0.8**k * float(loss)
    assert float(result.loss) == pytest.approx(total, rel=1e-5)
    result.loss.backward()
    assert drafter.fc.weight.grad is not None and drafter.embed_tokens.weight.grad is None


def test_step_loss_by_hand():
    """Forward KL against the verifier renormalised over the draft ids; a position whose verifier
    argmax lies outside the draft vocabulary is dropped; accuracy maps the drafter's argmax to target ids."""
    draft_ids, t2d = torch.tensor([1, 3]), torch.zeros(5, dtype=torch.bool)
    t2d[draft_ids] = True
    verifier = torch.tensor([[[0.0] * 5, [0.0, 2.0, 0.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0, 9.0], [0.0] * 5]])
    drafter = torch.tensor([[[0.0, 1.0], [0.0, 0.0], [5.0, 0.0], [0.0, 0.0]]])
    keep = torch.tensor([[True, True, True, False]])
    loss, acc, kept = step_loss(drafter, verifier, keep, draft_ids, t2d, step=0)
    assert kept.tolist() == [[True, False, False, False]]  # row 1's target: argmax 4, outside -> dropped
    p = torch.tensor([2.0, 1.0]).softmax(-1)
    q = torch.tensor([0.0, 1.0]).softmax(-1)
    assert float(loss) == pytest.approx(float((p * (p / q).log()).sum()), rel=1e-6)
    assert float(acc) == 0.0  # the drafter picks id 3, the verifier id 1


# ------------------------------------------------------------------ export and layer numbering


def test_export_reloads_with_equal_logits(tmp_path):
    verifier = llama_verifier(layers=8)
    drafter = randomized(Eagle3Drafter.from_verifier(verifier, draft_ids=DRAFT_IDS)).eval()
    folder = export_speculators(
        drafter, tmp_path / "eagle3", "org/verifier", speculative_tokens=5, include_embeddings=False
    )
    config = read_config(folder)
    assert config["speculators_config"]["algorithm"] == "eagle3"
    assert config["speculators_config"]["proposal_methods"] == [
        {"proposal_type": "greedy", "speculative_tokens": 5}
    ]
    assert config["speculators_config"]["verifier"]["name_or_path"] == "org/verifier"
    assert config["draft_vocab_size"] == len(DRAFT_IDS) and config["target_hidden_size"] == 32
    assert config["transformer_layer_config"]["vocab_size"] == VOCAB
    assert config["transformer_layer_config"]["rope_parameters"]["rope_theta"] == 5000.0
    json.dumps(config)
    loaded = load_speculators(folder, verifier).eval()
    ids, aux, _ = ttt_case()[2:]
    pos = torch.arange(9).expand(2, 9)
    with torch.no_grad():
        torch.testing.assert_close(
            loaded(ids, loaded.fuse(aux), pos).logits, drafter(ids, drafter.fuse(aux), pos).logits
        )
    assert torch.equal(
        load_speculators(export_speculators(drafter, tmp_path / "e", "v"), None).t2d, drafter.t2d
    )


def test_exported_layer_ids_are_the_inputs_of_those_verifier_layers(tmp_path):
    verifier = llama_verifier(layers=8)
    drafter = Eagle3Drafter.from_verifier(verifier, aux_layers=[1, 4, 6])
    ids = torch.tensor([[4, 9, 1, 7, 3]])
    exported = read_config(export_speculators(drafter, tmp_path, "v"))["eagle_aux_hidden_state_layer_ids"]
    assert exported == [1, 4, 6]
    check_layer_numbering(drafter, verifier, ids, exported)


def test_a_feature_from_the_wrong_layer_is_caught(tmp_path, monkeypatch):
    """Broken on purpose: the export writes "output of layer i" ids (SGLang's, one less), then the
    drafter reads hidden_states[i + 1]."""
    verifier = llama_verifier(layers=8)
    drafter = Eagle3Drafter.from_verifier(verifier)
    ids = torch.tensor([[4, 9, 1, 7, 3]])
    monkeypatch.setattr(
        speculators_module, "to_speculators_layer_ids", lambda layers: [i - 1 for i in layers]
    )
    exported = read_config(export_speculators(drafter, tmp_path, "v"))["eagle_aux_hidden_state_layer_ids"]
    with pytest.raises(AssertionError):
        check_layer_numbering(drafter, verifier, ids, exported)
    monkeypatch.undo()
    monkeypatch.setattr(Eagle3Drafter, "aux_features", lambda self, hs: [hs[i + 1] for i in self.aux_layers])
    with pytest.raises(AssertionError):
        check_layer_numbering(drafter, verifier, ids, drafter.aux_layers)


def test_the_speculators_export_refuses_other_than_three_aux_layers(tmp_path):
    """vLLM's EAGLE-3 builds ``fc`` for 3 x hidden inputs: any other count is refused before a file is
    written, with a message naming the setting."""
    verifier = llama_verifier(layers=8)
    for aux in ([1, 4], [1, 2, 4, 6]):
        drafter = Eagle3Drafter.from_verifier(verifier, aux_layers=aux)
        with pytest.raises(ValueError, match=r"method\.aux_layers.*list of 3"):
            export_speculators(drafter, tmp_path / str(len(aux)), "v")
        assert not (tmp_path / str(len(aux))).exists()


def test_the_speculators_export_carries_llama3_rope_scaling_for_older_readers(tmp_path):
    """Llama-3.1's scaled RoPE: transformers < 5 (and vLLM on it) read ``rope_scaling`` and the top-level
    ``rope_theta`` only; both give back the drafter's RoPE, and plain RoPE writes no ``rope_scaling``."""
    llama3 = {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=512,
        rope_parameters=dict(llama3),
    )
    drafter = Eagle3Drafter.from_verifier(LlamaForCausalLM(config).eval())
    layer = read_config(export_speculators(drafter, tmp_path / "llama3", "v"))["transformer_layer_config"]
    assert layer["rope_scaling"] == {k: v for k, v in drafter.rope_parameters.items() if k != "rope_theta"}
    assert layer["rope_scaling"]["rope_type"] == "llama3" and layer["rope_scaling"]["factor"] == 8.0
    assert layer["rope_theta"] == 500000.0
    old_reader = {k: v for k, v in layer.items() if k != "rope_parameters"}  # what transformers < 5 sees
    assert LlamaConfig(**old_reader).rope_parameters == drafter.rope_parameters
    plain = read_config(
        export_speculators(Eagle3Drafter.from_verifier(llama_verifier()), tmp_path / "p", "v")
    )
    assert "rope_scaling" not in plain["transformer_layer_config"]
