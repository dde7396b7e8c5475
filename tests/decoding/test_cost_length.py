"""The cost model (train/decoding/costs.py), the draft length it chooses (train/decoding/length_policy.py)
and chain SD under it (``SpeculativeDecoder(draft_length="cost")``).

Pure functions against hand-computed values; the policy's three choices on costs where drafting pays and
where it cannot; the decoder: Hugging Face's greedy output for three architectures, with prompt lookup,
EOS and every short limit; plain steps only (no drafter call) where no draft can pay; the exact output law
at T = 1 by chi-square against the verifier's enumerated law, while the policy's calibration moves
from call to call.

Broken on purpose (tried): choosing the verified prefix after the fact by the drawn tokens' own
probabilities (the first design) fails the law test (chi-square 243 against a critical 106); a
calibration that records every draft as accepted keeps drafting where nothing pays and fails
``test_where_nothing_pays_every_block_is_a_plain_step``.
"""

from __future__ import annotations

import sys

import pytest
import torch

import train.decoding.cost_probe as cost_probe
from train.decoding import SamplingParams, SpeculativeDecoder
from train.decoding.costs import (
    StepCosts,
    best_length,
    best_node_count,
    expected_tokens,
    speedup_bound,
    survival,
)
from train.decoding.length_policy import AcceptanceCalibration, CostAwareLength, chain_outcomes

from .decoding_helpers import hf_greedy
from .spec_reference import chi2_critical, chi_square, peaked_table_lm, run_many, table_next, verifier_joint

#: a float32 CPU as shipped: checking n tokens costs 1, 1.8, 1.85, ... one-token steps
STEEP = StepCosts(verify=(1.0, 1.8, 1.85, 1.9, 2.0, 2.1, 2.2, 2.3, 2.4), draft=0.05)
#: the streamed product: 2-4 tokens cost about one step
FLAT = StepCosts(verify=(1.0, 1.03, 1.05, 1.07, 1.4, 1.5, 1.6, 1.7, 1.8), draft=0.05)


def test_step_costs_extrapolate_and_validate():
    costs = StepCosts(verify=(2.0, 3.0, 5.0), draft=0.5)
    assert costs.check(3) == 5.0 and costs.check(5) == 9.0  # the last slope carries on
    assert costs.relative() == [1.0, 1.5, 2.5] and costs.draft_ratio == 0.25
    assert StepCosts.from_dict(costs.to_dict()) == costs
    for bad in ({"verify": ()}, {"verify": (1.0, 0.0)}, {"verify": (1.0,), "draft": -1.0}):
        with pytest.raises(ValueError):
            StepCosts(**bad)
    with pytest.raises(ValueError):
        costs.check(0)


def test_expected_tokens_best_length_and_the_bound_by_hand():
    a = [0.8, 0.5, 0.5]
    assert survival(a) == pytest.approx([0.8, 0.4, 0.2])
    assert expected_tokens(a) == pytest.approx(2.4)
    costs = StepCosts(verify=(1.0, 1.1, 1.2, 2.0), draft=0.1)
    # after 3 drafter steps (0.3 s spent): m = 0: 1 / 1.3; 1: 1.8 / 1.4; 2: 2.2 / 1.5; 3: 2.4 / 2.3
    assert best_length(a, costs, 3) == (2, pytest.approx(2.2 / 1.5))
    # the bound: n = 1: 1.8 / 1.2 = 1.5; n = 2: 2.2 / 1.4 = 1.571; n = 3: 2.4 / 2.3
    assert speedup_bound(a, costs) == (2, pytest.approx(2.2 / 1.4))
    assert speedup_bound([0.1, 0.1], StepCosts(verify=(1.0, 1.8, 1.9), draft=0.1)) == (0, 1.0)
    assert speedup_bound([0.9], costs, drafter_steps_per_draft=0.0) == (1, pytest.approx(1.9 / 1.1))


def test_best_node_count_by_hand_and_as_the_chains_rule():
    costs = StepCosts(verify=(1.0, 1.0, 1.0, 1.1, 1.5), draft=0.1)
    # a tree's nodes best first: the root's first and second candidates, then the first one's child, ...
    chances = [0.6, 0.3, 0.3, 0.05]
    # after one drafter forward (0.1 s): m = 0: 1 / 1.1; 1: 1.6 / 1.1; 2: 1.9 / 1.1; 3: 2.2 / 1.2;
    # 4: 2.25 / 1.6
    assert best_node_count(chances, costs, 1) == (3, pytest.approx(2.2 / 1.2))
    assert best_node_count([], costs, 1) == (0, pytest.approx(1 / 1.1))
    assert best_node_count([0.01], StepCosts(verify=(1.0, 1.5)), 0)[0] == 0  # nothing pays: a plain step
    a = [0.8, 0.5, 0.5]  # a chain is the tree whose node chances are the survivals
    steep = StepCosts(verify=(1.0, 1.1, 1.2, 2.0), draft=0.1)
    assert best_length(a, steep, 3) == best_node_count(survival(a), steep, 3)


def test_a_trees_outcomes_teach_the_calibration_every_tested_node():
    policy = CostAwareLength(FLAT)
    # nodes: 0 and 1 under the root, 2 under 0, 3 under 1, 4 under 2; the verifier accepted 0 then refused
    # 2: tested are 0, 1 (the root's children) and 2 (node 0's); 3 and 4 never were
    policy.record_tree("greedy", [0.55, 0.25, 0.45, 0.15, 0.95], [-1, -1, 0, 1, 2], [0])
    cal = policy.calibration("greedy")
    assert cal.tested == [0, 0, 1, 0, 1, 1, 0, 0, 0, 0] and cal.accepted == [0, 0, 0, 0, 0, 1, 0, 0, 0, 0]
    policy.record_tree("greedy", [0.55, 0.25], [-1, -1], [])  # nothing accepted: both root children refused
    assert cal.tested[5] == 2 and cal.accepted[5] == 1 and cal.tested[2] == 2
    with pytest.raises(ValueError):
        policy.record_tree("greedy", [0.5], [-1, -1], [])
    # the cut: the best-first nodes that pay; the first node as a probe where none does
    assert policy.cut_tree([0.9, 0.8, 0.7], FLAT) == 3
    assert policy.cut_tree([], FLAT) == 0


def test_calibration_shrinks_towards_the_drafters_probability():
    cal = AcceptanceCalibration(bins=10, prior=4.0)
    assert cal.estimate(0.35) == pytest.approx(0.35)  # nothing seen: the drafter's own probability
    for _ in range(36):
        cal.record(0.35, False)
    assert cal.estimate(0.35) == pytest.approx(4 * 0.35 / 40)
    assert cal.estimate(0.95) == pytest.approx(0.95)  # another bin
    assert chain_outcomes(3, 1) == [(0, True), (1, False)] and chain_outcomes(2, 2) == [(0, True), (1, True)]


def test_the_policy_drafts_long_on_flat_costs_and_short_or_nothing_on_steep_ones():
    flat, steep = CostAwareLength(FLAT), CostAwareLength(STEEP)
    assert flat.include("greedy", [0.95, 0.9, 0.9], 6)
    assert not flat.include("greedy", [0.95, 0.9, 0.9, 0.9], 4)  # a 5-token check costs 1.4 steps here
    assert flat.include("greedy", [0.3], 6)  # a 30% draft pays when a check costs 3% more ...
    assert not steep.include("greedy", [0.3], 6)  # ... and does not when it costs 80% more
    assert steep.include("greedy", [0.95], 6) and not steep.include("greedy", [0.95, 0.02], 6)
    # first drafts that are never accepted: plain steps, a probe after probe_every of them, then twice as
    # many after each probe that does not pay
    policy = CostAwareLength(STEEP, probe_every=4)
    for _ in range(20):
        policy.record("greedy", [0.5], 1, 0)
    drafted = [policy.should_draft("greedy", 6) for _ in range(12)]
    assert drafted == [False] * 3 + [True] + [False] * 7 + [True]
    assert CostAwareLength(FLAT).should_draft("greedy", 6)
    # copies: cut where the copies' acceptance so far makes the next one not pay
    assert CostAwareLength(FLAT).choose_copied("greedy", 6) == 3  # prior 0.5: 4 checked tokens, not 5
    copies = CostAwareLength(STEEP, probe_every=3)
    for _ in range(30):
        copies.record_copied("greedy", 3, 0)
    assert [copies.choose_copied("greedy", 6) for _ in range(9)] == [0, 0, 6] + [0] * 5 + [6]
    with pytest.raises(RuntimeError, match="no step costs"):
        CostAwareLength().include("greedy", [0.5], 1)


def test_a_first_draft_refused_by_its_calibration_is_probed_and_recovers():
    """A block whose first draft the calibration refuses is a plain step as much as one refused before
    the drafter ran: the probes count both, and a probe verifies its first draft whatever the calibration
    says. Without that the policy, once its calibration turned low, never verified a draft again (the
    real pair, 2026-11-29: 10 drafts in 487 blocks with a drafter whose first drafts pass half the time)."""
    mid = StepCosts(verify=(1.0, 1.2, 1.3, 1.4, 1.5, 1.6, 1.7), draft=0.05)
    policy = CostAwareLength(mid, probe_every=3)
    for _ in range(40):  # drafts at confidence 0.3 were never accepted; first drafts in general were
        policy.record("greedy", [0.3], 1, 0)
    for _ in range(40):
        policy.record("greedy", [0.95], 1, 1)
    verified = []
    for _ in range(9):
        assert policy.should_draft("greedy", 6)  # first drafts pay on the whole ...
        verified.append(policy.include("greedy", [0.3], 6))  # ... this one's calibration does not
    assert verified == [False, False, True] + [False] * 5 + [True]  # probes, backing off
    assert policy.should_draft("greedy", 6) and policy.include("greedy", [0.95], 6)  # on its merits
    assert not policy.include("greedy", [0.95, 0.02], 6)  # later positions are never probed
    # one forward's drafts (DFlash): none pays, so none is verified but the first, as a probe
    cut = CostAwareLength(STEEP, probe_every=2)
    for _ in range(40):
        cut.record("greedy", [0.3], 1, 0)
    assert [cut.cut("greedy", [0.3, 0.3], STEEP) for _ in range(4)] == [0, 1, 0, 0]
    assert cut.cut("greedy", [], STEEP) == 0
    assert CostAwareLength(FLAT).cut("greedy", [0.95, 0.9, 0.9], FLAT) == 3


def _repetitive_prompt(seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    motif = torch.randint(2, 128, (5,), generator=gen)
    return torch.cat([motif, torch.randint(2, 128, (3,), generator=gen), motif[:3]]).reshape(1, -1)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gpt2"])
@pytest.mark.parametrize("costs", [FLAT, STEEP], ids=["flat", "steep"])
def test_cost_chosen_lengths_keep_the_greedy_output(tiny_pairs, arch, costs):
    """Chains of every chosen length, plain steps, copies cut to a prefix: the verifier's greedy output."""
    verifier, drafter = tiny_pairs[arch]
    lengths = set()
    for seed in range(3):
        ids = _repetitive_prompt(seed)
        ref = hf_greedy(verifier, ids, 40)
        for lookup in (0, 6):
            dec = SpeculativeDecoder(
                verifier,
                drafter,
                gamma=6,
                draft_length="cost",
                costs=costs,
                lookup_tokens=lookup,
                lookup_min_ngram=1,
            )
            res = dec.generate(ids, 40)
            assert res.tokens.tolist() == ref, (arch, seed, lookup)
            lengths.update(range(len(res.stats.position_drafted)))
            assert res.stats.verifier_calls >= res.stats.drafter_calls / 6
    if costs is FLAT:  # on steep costs this random pair's drafts never pay: plain steps throughout
        assert len(lengths) >= 2, lengths


def test_cost_chosen_lengths_stop_at_eos_and_at_every_limit(llama_pair):
    verifier, drafter = llama_pair
    ids = _repetitive_prompt(3)
    free = hf_greedy(verifier, ids, 30)
    eos = free[7]
    ref = hf_greedy(verifier, ids, 30, eos=eos)
    assert ref[-1] == eos and len(ref) < 30
    for n in (0, 1, 2, 5, 30):
        dec = SpeculativeDecoder(verifier, drafter, gamma=4, draft_length="cost", costs=FLAT, lookup_tokens=4)
        assert dec.generate(ids, n, eos_token_id=eos).tokens.tolist() == ref[:n], n


def test_another_drafter_step_is_taken_only_where_it_can_pay_for_itself():
    """extend weighs the next drafter step before it runs (include only the check of a draft already
    drafted): on checks that are flat to 8 tokens, a 30% draft is worth verifying once drafted but not
    worth a drafter step that costs 0.3 of a verifier step; a 95% one is."""
    flat_checks = StepCosts(verify=(1.0, 1.01, 1.02, 1.03, 1.04, 1.05, 1.06, 1.07, 1.08), draft=0.3)
    policy = CostAwareLength(flat_checks)
    assert policy.include("greedy", [0.3], 6)
    assert not policy.extend("greedy", [0.3], 6)
    assert policy.extend("greedy", [0.95], 6)
    assert not policy.extend("greedy", [0.95, 0.95], 2)  # the budget is spent


def test_a_cheap_check_does_not_make_the_chain_run_to_the_cap():
    """Checks nearly flat, a drafter step 0.3 of a verifier step, drafts taken about half the time (the
    peaked table pair at T = 1): blocks draft a token or two, not gamma (before extend every block that
    drafted ran to gamma, each drafter step spent before it was weighed)."""
    verifier, drafter = peaked_table_lm(V, 1, 3.0, 0.0), peaked_table_lm(V, 2, 1.0, 0.0)
    costs = StepCosts(verify=(1.0, 1.01, 1.02, 1.03, 1.04, 1.05), draft=0.3)
    dec = SpeculativeDecoder(verifier, drafter, gamma=4, draft_length="cost", costs=costs)
    runs = run_many(dec, PROMPT, 5, SamplingParams(temperature=1.0), 300, seed=5, eos=EOS)
    drafter_calls = sum(s.drafter_calls for s in runs.stats)
    blocks = sum(s.verifier_calls for s in runs.stats)
    accepted = sum(s.accepted for s in runs.stats) / max(1, sum(s.tested for s in runs.stats))
    assert drafter_calls <= 2.0 * blocks, (drafter_calls, blocks, accepted)


def test_where_nothing_pays_every_block_is_a_plain_step(llama_pair):
    """A drafter whose drafts the verifier never takes, on a machine where a check costs twice a step:
    after a few blocks the decoder stops calling the drafter (bar its probes) and runs at one token per
    verifier call, as plain decoding does."""
    verifier, drafter = llama_pair
    costs = StepCosts(verify=(1.0, 2.0, 2.1, 2.2, 2.3), draft=0.2)
    dec = SpeculativeDecoder(verifier, drafter, gamma=4, draft_length="cost", costs=costs)
    ids = _repetitive_prompt(5)
    res = dec.generate(ids, 60)
    assert res.tokens.tolist() == hf_greedy(verifier, ids, 60)
    s = res.stats
    assert s.drafter_calls < 25 and s.verifier_calls > 45, (s.drafter_calls, s.verifier_calls)


def test_bad_settings_raise(llama_pair):
    verifier, drafter = llama_pair
    with pytest.raises(ValueError, match="draft_length"):
        SpeculativeDecoder(verifier, drafter, draft_length="auto")
    with pytest.raises(ValueError, match="exclude each other"):
        SpeculativeDecoder(verifier, drafter, draft_length="cost", confidence_threshold=0.3)


def test_costs_are_measured_once_when_not_given(llama_pair, tmp_path, monkeypatch):
    monkeypatch.setenv("DRAFTSMITH_COST_CACHE", str(tmp_path / "costs.json"))
    monkeypatch.setattr(cost_probe, "_MEMO", {})  # this process's earlier measurements are not seen
    verifier, drafter = llama_pair
    dec = SpeculativeDecoder(verifier, drafter, gamma=3, draft_length="cost")
    assert dec.step_costs is None
    dec.generate(_repetitive_prompt(0), 5)
    costs = dec.step_costs
    assert costs is not None and len(costs.verify) == 9 and costs.draft > 0
    assert (tmp_path / "costs.json").is_file()
    again = SpeculativeDecoder(verifier, drafter, gamma=3, draft_length="cost")
    again.generate(_repetitive_prompt(0), 5)
    assert again.step_costs == costs  # the process's memo (and the file) give the same figures


def test_every_drafter_of_a_verifier_is_weighed_against_one_measurement_of_its_checks(
    llama_pair, tmp_path, monkeypatch
):
    """The checks are the verifier's alone: measured once per verifier and setting, whatever the drafter,
    so decoders of two drafters choose by the same check costs; each drafter's step is its own."""
    import copy

    monkeypatch.setenv("DRAFTSMITH_COST_CACHE", str(tmp_path / "costs.json"))
    monkeypatch.setattr(cost_probe, "_MEMO", {})
    verifier, drafter = llama_pair
    other = copy.deepcopy(drafter)
    other.config._name_or_path = "another-drafter"
    measured: list[object] = []
    real = cost_probe.measure_step_costs

    def measure(model, with_drafter, *args, **kwargs):
        measured.append(with_drafter)
        return real(model, with_drafter, *args, **kwargs, repeats=1)

    monkeypatch.setattr(cost_probe, "measure_step_costs", measure)
    first = SpeculativeDecoder(verifier, drafter, gamma=3, draft_length="cost").measure_costs()
    second = SpeculativeDecoder(verifier, other, gamma=3, draft_length="cost").measure_costs()
    assert measured == [None]  # the checks once, without a drafter
    assert first.verify == second.verify and first.draft > 0 and second.draft > 0


V, EOS, PROMPT = 4, 3, (2, 0)


@pytest.mark.parametrize("lookup", [0, 3])
def test_the_output_law_is_the_verifiers_at_t1(lookup):
    """4,000 sampled decodes of the peaked table pair (q != p, EOS in play), the policy deciding per
    block from flat costs and its calibration, which changes from call to call; chi-square (alpha 1e-4)
    against the verifier's enumerated law. Broken on purpose (tried): drafting from q but handing the
    rule the next position's q row moved the statistic far past the critical value."""
    verifier, drafter = peaked_table_lm(V, 1, 3.0, 0.0), peaked_table_lm(V, 2, 4.5, 1.5)
    params = SamplingParams(temperature=1.0)
    costs = StepCosts(verify=(1.0, 1.02, 1.3, 1.9, 2.5), draft=0.1)
    dec = SpeculativeDecoder(
        verifier,
        drafter,
        gamma=4,
        draft_length="cost",
        costs=costs,
        lookup_tokens=lookup,
        lookup_min_ngram=1,
        lookup_max_ngram=2,
    )
    n = 4000
    runs = run_many(dec, PROMPT, 5, params, n, seed=3, eos=EOS)
    target = verifier_joint(table_next(verifier, params), PROMPT, 5, (EOS,))
    stat, df = chi_square(runs.counts, target, n)
    assert stat < chi2_critical(df), (stat, df, chi2_critical(df))
    lengths = {len(s.position_drafted) for s in runs.stats}
    assert len(lengths) >= 2, lengths


def test_costs_measured_under_a_profiler_stay_out_of_the_disk_cache(tmp_path, monkeypatch):
    """A profiled run's costs include the profiler's: its process uses them, the disk cache never gets
    them (a profiled evaluation once cached a drafter step of 4.0 ms for one of 2.1 ms, and later runs
    chose their draft lengths by it). Broken on purpose (tried): writing them regardless fails the first
    assertion on the file."""
    path = tmp_path / "costs.json"
    monkeypatch.setenv("DRAFTSMITH_COST_CACHE", str(path))
    monkeypatch.setattr(cost_probe, "_MEMO", {})
    costs = StepCosts(verify=(1.0, 1.1), draft=0.1)
    previous = sys.getprofile()
    sys.setprofile(lambda *_: None)
    try:
        assert cost_probe.instrumented()
        measured, _ = cost_probe.remembered("profiled", lambda: (costs, None))
    finally:
        sys.setprofile(previous)
    assert measured == costs and not path.exists()
    assert cost_probe.remembered("profiled", lambda: (StepCosts(verify=(9.0,), draft=9.0), None))[0] == costs
    cost_probe.remembered("plain", lambda: (costs, None))  # not profiled: written
    assert path.is_file() and "plain" in path.read_text() and "profiled" not in path.read_text()
