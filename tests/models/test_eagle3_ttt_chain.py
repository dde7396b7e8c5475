"""EAGLE-3's teacher-forced chain statistics (train/models/eagle3_ttt.py): ``step_hits`` and
``chain_counts`` on hand-made tensors, ``chain_counts`` against a slow per-position loop on random masks,
and ``ttt_loss``'s ``hits`` / ``eligible`` as the validation reads them."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from train.models.eagle3_drafter import Eagle3Drafter
from train.models.eagle3_ttt import chain_counts, step_hits, ttt_loss, ttt_unroll

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one thread (tests/conftest.py)

T, F = True, False


def _masks(rows: list[list[list[bool]]]) -> list[torch.Tensor]:
    """Per step, a (B, T) bool tensor from nested lists [step][batch][position]."""
    return [torch.tensor(step, dtype=torch.bool) for step in rows]


def _ints(counts: dict[str, torch.Tensor]) -> dict[str, int]:
    return {k: int(v) for k, v in counts.items()}


# ------------------------------------------------------------------ step_hits


def _one_hot_logits(argmaxes: list[int], width: int) -> torch.Tensor:
    """(1, T, width) logits whose argmax at row t is ``argmaxes[t]``."""
    logits = torch.zeros(1, len(argmaxes), width)
    for t, a in enumerate(argmaxes):
        logits[0, t, a] = 1.0
    return logits


def test_step_hits_compare_the_mapped_argmax_with_the_verifier_rows_ahead():
    draft_ids = torch.tensor([0, 2, 4, 5])  # draft index i -> target id draft_ids[i]
    # the verifier's argmax per row (vocabulary 6); row r predicts token r + 1
    verifier = _one_hot_logits([1, 2, 4, 3, 5, 0], 6)
    # the drafter's argmax (draft indices) per position at step 0: targets 2, 4, 4, 5, 0, 2
    step0 = _one_hot_logits([1, 2, 2, 3, 0, 1], 4)
    # position p at step 0 is compared with verifier row p + 1: 2==2, 4==4, 4!=3, 5==5, 0==0, past the end
    assert step_hits(step0, verifier, draft_ids, 0).tolist() == [[T, T, F, T, T, F]]
    # step 1 compares with row p + 2: 2!=4, 4!=3, 4!=5, 5!=0, then past the end
    assert step_hits(step0, verifier, draft_ids, 1).tolist() == [[F, F, F, F, F, F]]
    # targets 4, 5, 5, 0 against rows 2..5 (4, 3, 5, 0); id 3 is outside the draft vocabulary: a miss
    step1 = _one_hot_logits([2, 3, 3, 0, 0, 0], 4)
    assert step_hits(step1, verifier, draft_ids, 1).tolist() == [[T, F, T, T, F, F]]
    # a step reaching past the sequence everywhere has no hit
    assert not step_hits(step1, verifier, draft_ids, 5).any()
    assert not step_hits(step1, verifier, draft_ids, 9).any()


def test_step_hits_do_not_compare_draft_indices_with_target_ids():
    """Broken-on-purpose guard: without the d2t mapping, draft index 1 would "hit" verifier id 1."""
    draft_ids = torch.tensor([3, 7])
    verifier = _one_hot_logits([0, 1, 7, 3], 8)
    drafter = _one_hot_logits([1, 1, 0, 0], 2)  # targets 7, 7, 3, 3
    assert step_hits(drafter, verifier, draft_ids, 0).tolist() == [[F, T, T, F]]


def test_step_hits_per_batch_row():
    draft_ids = torch.arange(5)
    verifier = torch.cat([_one_hot_logits([0, 1, 2, 3], 5), _one_hot_logits([0, 4, 4, 4], 5)])
    drafter = torch.cat([_one_hot_logits([1, 2, 0, 0], 5), _one_hot_logits([4, 4, 1, 4], 5)])
    assert step_hits(drafter, verifier, draft_ids, 0).tolist() == [[T, T, F, F], [T, T, F, F]]


# ------------------------------------------------------------------ chain_counts


def test_chain_counts_by_hand():
    eligible = _masks([[[T, T, T, F]], [[T, T, F, F]], [[T, F, F, F]]])
    hits = _masks([[[T, F, T, F]], [[T, T, F, F]], [[F, F, F, F]]])
    counts = _ints(chain_counts(hits, eligible))
    # starts: positions 0, 1, 2. Step 0: all three reached, 0 and 2 hit. Step 1: only 0 still eligible
    # (2's target is past the answer) and it hits; position 1's hit at step 1 does not count (dead chain).
    # Step 2: 0 reached, missed. Chains: 2, 0, 1 -> run 3.
    assert counts == {
        "starts": 3,
        "cond_n_0": 3,
        "cond_hit_0": 2,
        "cond_n_1": 1,
        "cond_hit_1": 1,
        "cond_n_2": 1,
        "cond_hit_2": 0,
        "run": 3,
    }
    assert 1 + counts["run"] / counts["starts"] == pytest.approx(2.0)


def test_chain_counts_ignore_hits_where_nothing_is_eligible():
    eligible = _masks([[[T, F, T], [F, F, F]], [[T, F, F], [F, F, F]]])
    hits = _masks([[[T, T, T], [T, T, T]], [[T, T, T], [T, T, T]]])
    counts = _ints(chain_counts(hits, eligible))
    assert counts == {
        "starts": 2,
        "cond_n_0": 2,
        "cond_hit_0": 2,
        "cond_n_1": 1,
        "cond_hit_1": 1,
        "run": 3,
    }


def test_chain_counts_every_chain_full_or_none():
    eligible = [torch.ones(2, 5, dtype=torch.bool)] * 4
    full = _ints(chain_counts([torch.ones(2, 5, dtype=torch.bool)] * 4, eligible))
    assert full["starts"] == 10 and full["run"] == 40
    assert all(full[f"cond_n_{k}"] == full[f"cond_hit_{k}"] == 10 for k in range(4))
    none = _ints(chain_counts([torch.zeros(2, 5, dtype=torch.bool)] * 4, eligible))
    assert none["run"] == 0 and none["cond_n_0"] == 10 and none["cond_hit_0"] == 0
    assert all(none[f"cond_n_{k}"] == 0 for k in range(1, 4))


def _reference(hits: list[torch.Tensor], eligible: list[torch.Tensor]) -> dict[str, int]:
    """Position by position: walk each chain from an eligible start until a step is ineligible or a miss."""
    steps = len(hits)
    batch, length = hits[0].shape
    out = {"starts": 0, "run": 0, **{f"cond_{w}_{k}": 0 for k in range(steps) for w in ("n", "hit")}}
    for b in range(batch):
        for p in range(length):
            if not eligible[0][b, p]:
                continue
            out["starts"] += 1
            for k in range(steps):
                if not eligible[k][b, p]:
                    break
                out[f"cond_n_{k}"] += 1
                if not hits[k][b, p]:
                    break
                out[f"cond_hit_{k}"] += 1
                out["run"] += 1
    return out


@pytest.mark.parametrize("seed", range(8))
def test_simulated_block_efficiency_equals_a_slow_loop_on_random_masks(seed):
    gen = torch.Generator().manual_seed(seed)
    steps = 1 + seed % 5
    batch, length = 3, 11
    p_hit = 0.3 + 0.1 * (seed % 6)
    eligible = [torch.rand(batch, length, generator=gen) < 0.85 for _ in range(steps)]
    hits = [torch.rand(batch, length, generator=gen) < p_hit for _ in range(steps)]
    counts = _ints(chain_counts(hits, eligible))
    want = _reference(hits, eligible)
    assert counts == want
    assert want["starts"] > 0
    tau = 1 + counts["run"] / counts["starts"]
    assert tau == pytest.approx(1 + want["run"] / want["starts"])
    assert 1.0 <= tau <= 1 + steps


# ------------------------------------------------------------------ ttt_loss's masks


def test_ttt_hits_are_kept_positions_of_step_hits_and_chain_within_eligible():
    """``ttt_loss``'s masks on a verifier whose rows are set to what the drafter predicts (even rows: its
    step-0 guess from the row before; odd rows: its step-1 guess from two rows before; row 5: an id outside
    the draft vocabulary), so chains of two hits exist and one target is not draftable."""
    torch.manual_seed(0)
    verifier = LlamaForCausalLM(
        LlamaConfig(
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=40,
        )
    ).eval()
    drafter = Eagle3Drafter.from_verifier(verifier, draft_ids=list(range(0, 40, 2))).eval()
    batch, length, steps = 2, 10, 3
    ids = torch.randint(0, 40, (batch, length))
    loss_mask = torch.zeros(batch, length, dtype=torch.bool)
    loss_mask[:, 2:9] = True
    with torch.no_grad():
        out = verifier(ids, output_hidden_states=True)
        aux = torch.cat(drafter.aux_features(out.hidden_states), dim=-1)
        unrolled = ttt_unroll(drafter, drafter.fuse(aux), ids, steps=steps)
    guesses = [drafter.draft_ids[logits.argmax(-1)] for logits in unrolled]  # target ids (B, T)
    rows = torch.randint(0, 40, (batch, length))
    for r in range(2, length):
        rows[:, r] = guesses[0][:, r - 1] if r % 2 == 0 else guesses[1][:, r - 2]
    rows[:, 5] = 1  # odd: outside the draft vocabulary
    verifier_logits = torch.nn.functional.one_hot(rows, 40).float() * 5.0
    with torch.no_grad():
        result = ttt_loss(drafter, aux, ids, verifier_logits, loss_mask, steps=steps)
    assert len(result.hits) == len(result.eligible) == steps
    for k, (hit, keep) in enumerate(zip(result.hits, result.eligible, strict=True)):
        # eligible at p: the target row p + 1 + k is inside the sequence and the loss mask
        want = torch.zeros(batch, length, dtype=torch.bool)
        want[:, : length - 1 - k] = loss_mask[:, 1 + k :]
        assert torch.equal(keep, want)
        assert not (hit & ~keep).any()
        # kept: eligible and the verifier's argmax at the target row inside the draft vocabulary
        kept = torch.zeros(batch, length, dtype=torch.bool)
        kept[:, : length - 1 - k] = drafter.t2d[rows[:, 1 + k :]]
        kept &= keep
        assert int(kept.sum()) == result.counts[k] and not kept[:, 4 - k].any()  # row 5 never counts
        assert torch.equal(hit, step_hits(unrolled[k], verifier_logits, drafter.draft_ids, k) & kept)
    # step 0 hits where the target row is even (p odd), step 1 where it is odd (p odd again), row 5 aside
    assert result.hits[0][:, [1, 3, 5, 7]].all() and result.hits[1][:, [1, 5]].all()
    assert not result.hits[1][:, 3].any()  # row 5 is not draftable
    counts = _ints(chain_counts(result.hits, result.eligible))
    assert counts == _reference(result.hits, result.eligible)
    assert counts["starts"] == int(result.eligible[0].sum()) == batch * 7  # rows 1..7 predict rows 2..8
    assert counts["cond_hit_1"] >= 2 * batch  # chains of two from positions 1 and 5
