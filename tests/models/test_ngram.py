"""The n-gram model: interpolated Kneser-Ney by hand on a tiny corpus, normalisation over the
vocabulary for every context, unseen contexts and tokens, save / load."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from train.models.ngram import NGramLM

D = 0.75
V = 5
# two documents; n-grams never cross them
DOCS = [[0, 1, 2, 0, 1, 3], [1, 2, 0, 1]]


def test_bigram_probabilities_by_hand():
    lm = NGramLM(2, V, D).fit(DOCS)
    # bigrams: (0,1) x3, (1,2) x2, (2,0) x2, (1,3) x1 -> 4 types
    # unigram continuation counts N1+(. w): w=0: {2} -> 1; w=1: {0} -> 1; w=2: {1} -> 1; w=3: {1} -> 1;
    # token 1 also starts document 2 but has a left extension already. Total 4, 4 types.
    p_uni = {w: max(c - D, 0) / 4 + D * 4 / 4 / V for w, c in {0: 1, 1: 1, 2: 1, 3: 1, 4: 0}.items()}
    # context 1: c(1 .) = 3 (2 x2, 3 x1), 2 types
    expected_2_after_1 = (2 - D) / 3 + D * 2 / 3 * p_uni[2]
    expected_4_after_1 = D * 2 / 3 * p_uni[4]  # never seen: only the lower order
    got = np.exp(lm.logprob([[1], [1], [4]], [2, 4, 0]))
    assert got[0] == pytest.approx(expected_2_after_1)
    assert got[1] == pytest.approx(expected_4_after_1)
    assert got[2] == pytest.approx(p_uni[0])  # context 4 never seen: falls through to the unigram
    assert np.exp(lm.logprob(np.zeros((1, 0), dtype=np.int64), [4]))[0] == pytest.approx(p_uni[4])


@pytest.mark.parametrize("order", [1, 2, 3, 4])
def test_every_context_is_a_distribution(order):
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, V, size=40) for _ in range(3)] + DOCS
    lm = NGramLM(order, V, D).fit(docs)
    for ctx in itertools.product(range(V), repeat=order - 1):
        probs = np.exp(lm.logprob(np.array([ctx] * V).reshape(V, order - 1), np.arange(V)))
        assert probs.sum() == pytest.approx(1.0, abs=1e-9) and (probs > 0).all()


def test_longer_context_than_the_order_uses_its_last_tokens(tmp_path):
    lm = NGramLM(3, V, D).fit(DOCS)
    short = lm.logprob([[2, 0]], [1])
    assert lm.logprob([[4, 4, 2, 0]], [1]) == pytest.approx(short)
    assert math.exp(float(short[0])) > 0.5  # "2 0 -> 1" is certain in the data
    lm.save(tmp_path / "lm")
    again = NGramLM.load(tmp_path / "lm")
    contexts = np.array([[0, 1], [1, 2], [3, 3]])
    np.testing.assert_allclose(again.logprob(contexts, [2, 0, 1]), lm.logprob(contexts, [2, 0, 1]))


def test_bad_input_is_refused(tmp_path):
    with pytest.raises(ValueError, match="token ids"):
        NGramLM(2, V).fit([[0, 9]])
    with pytest.raises(ValueError, match="too short"):
        NGramLM(4, V).fit([[0, 1]])
    with pytest.raises(RuntimeError, match="not fitted"):
        NGramLM(2, V).logprob([[0]], [1])
    with pytest.raises(FileNotFoundError, match="no n-gram model"):
        NGramLM.load(tmp_path)


def test_a_real_vocabulary_fits_a_4gram_key_and_one_too_large_is_refused():
    """SmolLM2's 49,152 ids: 49152**4 < 2**63, so 4-gram keys (and context x vocabulary) fit int64."""
    vocab = 49152
    top = vocab - 1
    lm = NGramLM(4, vocab).fit([[top, top - 1, top, top - 1, top], [0, 1, 2, 3]])
    logp = lm.logprob([[top, top - 1, top]], [top - 1])
    assert np.isfinite(logp).all() and float(np.exp(logp[0])) > 0.5  # the seen continuation dominates
    with pytest.raises(ValueError, match="does not fit an int64 key"):
        NGramLM(4, 55109)  # 55109**4 > 2**63
