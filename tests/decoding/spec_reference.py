"""Cache-free reference implementations of chain speculative decoding (docs/decoding.md).

Used by the decoder-level tests to pin the decoders' *exact* behaviour through their public API:

- :func:`reference_greedy`: a plain-Python loop at temperature 0 that re-encodes the whole sequence
  for every drafter step and every verifier call (no KV cache anywhere), returning the tokens and the
  exact counts the decoder's ``DecodeStats`` must report.
- :class:`ExactSpec`: the exact distribution of everything ``SpeculativeDecoder.generate``
  returns at temperature > 0 (the emitted tokens *and* the statistics' counts), by enumerating every
  draft, every accept/reject outcome and every next token, for small vocabularies (the table-driven
  fakes). A ``mutation`` argument computes the same for deliberately broken rules, so a test can state
  (and assert) its statistical power against them.
- :func:`verifier_joint`: the exact distribution of the verifier's own sampled continuation (EOS ends
  it), the target a lossless decoder must reproduce.

Conventions (those of the decoders): the draft budget of a block is ``min(gamma, remaining - 1)``; the
drafter stops drafting after it drafted an EOS; an accepted EOS gets no bonus token; output is cut after
the first EOS and at ``max_new_tokens``; the drafter's proposals live on the verifier's vocabulary (zero
mass on ids the drafter cannot produce) and ids the drafter cannot embed are fed to it as ``pad_id``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from statistics import NormalDist

import torch

from train.decoding import SamplingParams, warp

# ---------------------------------------------------------------- greedy reference (HF models)


@dataclass
class RefStats:
    """The counts a decoder must report, as the reference computes them."""

    tokens: list[int] = field(default_factory=list)
    drafted: int = 0
    accepted: int = 0
    verifier_calls: int = 0
    drafter_calls: int = 0
    verifier_tokens: int = 0
    tested: int = 0
    rollbacks: int = 0
    discarded: int = 0
    sum_expected_acceptance: float = 0.0
    position_drafted: list[int] = field(default_factory=list)
    position_tested: list[int] = field(default_factory=list)
    position_accepted: list[int] = field(default_factory=list)

    def bump(self, name: str, depth: int) -> None:
        lst = getattr(self, name)
        while len(lst) <= depth:
            lst.append(0)
        lst[depth] += 1


def trim(values: Sequence[int]) -> list[int]:
    """A per-position list without its trailing zeros (lists may be padded or grow with the draft)."""
    out = list(values)
    while out and out[-1] == 0:
        out.pop()
    return out


@torch.no_grad()
def full_logits(model: torch.nn.Module, tokens: Sequence[int]) -> torch.Tensor:
    """Logits (T, V) of a fresh, cache-free forward over ``tokens``."""
    ids = torch.tensor([list(tokens)], dtype=torch.long)
    return model(input_ids=ids, use_cache=False).logits[0].float()


def reference_greedy(
    verifier: torch.nn.Module,
    drafter: torch.nn.Module,
    prompt: Sequence[int],
    max_new_tokens: int,
    gamma: int,
    eos: Iterable[int] = (),
    drafter_pad_id: int = 0,
) -> RefStats:
    """Chain speculative decoding at T = 0 with no cache at all (docs/decoding.md).

    Each drafter step is an argmax over the drafter's logits (restricted to ids the verifier has) of a
    full forward over prompt + committed + drafts so far; each block is one full verifier forward.
    Drafted, tested, accepted are counted per depth; at T = 0 the expected acceptance of a tested
    position is 1 when the argmaxes agree, so ``sum_expected_acceptance`` equals the accepted count.
    """
    eos = frozenset(eos)
    v_vocab = verifier.get_output_embeddings().weight.shape[0]
    d_embed = drafter.get_input_embeddings().weight.shape[0]
    seq = list(prompt)
    limit = len(prompt) + max_new_tokens
    st = RefStats()
    done = max_new_tokens == 0
    while not done:
        budget = min(gamma, limit - len(seq) - 1)
        draft: list[int] = []
        while len(draft) < budget:
            fed = [t if t < d_embed else drafter_pad_id for t in seq + draft]
            logits = full_logits(drafter, fed)[-1]
            x = int(logits[:v_vocab].argmax())
            st.drafter_calls += 1
            draft.append(x)
            if x in eos:
                break
        k = len(draft)
        target = full_logits(verifier, seq + draft)[-(k + 1) :].argmax(dim=-1).tolist()
        st.verifier_calls += 1
        st.verifier_tokens += k + 1
        n = 0
        while n < k and draft[n] == target[n]:
            n += 1
        tested = min(n + 1, k)
        st.drafted += k
        st.accepted += n
        st.tested += tested
        st.sum_expected_acceptance += n
        st.discarded += k - tested
        st.rollbacks += int(n < k)
        for i in range(k):
            st.bump("position_drafted", i)
        for i in range(tested):
            st.bump("position_tested", i)
        for i in range(n):
            st.bump("position_accepted", i)
        new = draft[:n]
        if not (k and n == k and draft[-1] in eos):
            new.append(target[n])
        for j, x in enumerate(new):
            if x in eos:
                new, done = new[: j + 1], True
                break
        room = limit - len(seq)
        if len(new) >= room:
            new, done = new[:room], True
        seq.extend(new)
    st.tokens = seq[len(prompt) :]
    return st


# ---------------------------------------------------------------- exact distributions (small vocab)

#: name -> description of the deliberate defects :func:`exact_spec_distribution` can model.
MUTATIONS = {
    None: "the correct rule",
    "accept_x0.9": "acceptance probability multiplied by 0.9 (u * q_x < 0.9 * p_x)",
    "accept_x0.97": "acceptance probability multiplied by 0.97 (a 3% bias)",
    "residual_from_p": "the next token after a rejection drawn from p instead of norm(max(0, p - q))",
}

NextDist = Callable[[tuple[int, ...]], torch.Tensor]


def lenience_fn(lenience: str | None, eps: float) -> Callable[[float], float]:
    if lenience is None or eps == 1.0:
        return lambda p: p
    return {
        "linear": lambda p: p / eps,
        "squared": lambda p: p / (eps * eps),
        "exponential": lambda p: p**eps,
    }[lenience]


def table_next(model, params: SamplingParams, vocab: int | None = None, pad_id: int = 0) -> NextDist:
    """Warped next-token distribution (float64) of a ``TableLM`` after a prefix, on ``vocab`` ids.

    ids the model cannot embed are fed as ``pad_id``; a smaller output is zero-padded to ``vocab``, a
    larger one cut to ``vocab`` before warping (as the decoder's proposer does).
    """
    own = model.table.shape[0]
    cache: dict[tuple[int, ...], torch.Tensor] = {}

    def nxt(prefix: tuple[int, ...]) -> torch.Tensor:
        if prefix not in cache:
            fed = [t if t < own else pad_id for t in prefix]
            logits = model.next_logits(fed)
            if vocab is not None and vocab < logits.shape[0]:
                logits = logits[:vocab]  # a larger drafter's extra ids are never proposed
            probs = warp(logits, params).double()
            if vocab is not None and vocab > probs.shape[0]:
                probs = torch.nn.functional.pad(probs, (0, vocab - probs.shape[0]))
            cache[prefix] = probs
        return cache[prefix]

    return nxt


def copied_draft(
    seq: tuple[int, ...], num_tokens: int, max_ngram: int, min_ngram: int, eos: frozenset[int]
) -> tuple[int, ...]:
    """Prompt lookup, written independently of the engine's: the tokens after the last earlier
    occurrence of the longest matching tail n-gram (n from max_ngram down to min_ngram), up to
    ``num_tokens``, cut after an EOS."""
    for n in range(max_ngram, min_ngram - 1, -1):
        if len(seq) <= n:
            continue
        starts = [s for s in range(len(seq) - n) if seq[s : s + n] == seq[len(seq) - n :]]
        if starts:
            copied = seq[max(starts) + n :][:num_tokens]
            ends = [j for j, x in enumerate(copied) if x in eos]
            return copied[: ends[0] + 1] if ends else copied
    return ()


class ExactSpec:
    """Exact law of one sampled ``SpeculativeDecoder.generate`` (small vocabularies only).

    ``p_next`` / ``q_next`` map a prefix (tuple of ids) to the warped verifier / drafter distribution
    over the verifier's vocabulary. ``mutation`` (a key of :data:`MUTATIONS`) models a broken rule.
    ``confidence_threshold``: the chain ends after a draft x with q(x) below it (adaptive length).
    ``lookup`` = (num_tokens, max_ngram, min_ngram): prompt lookup first (:func:`copied_draft`, a point
    mass per token, no drafter call); the drafter's chain where it copies nothing.

    - :meth:`distribution`: {emitted tokens: probability};
    - :meth:`expectations`: E[count] of accepted, drafted, tested, verifier_calls, drafter_calls,
      new_tokens, sum_expected (sum over tested positions of the test's expectation
      sum_v min(q(v), f(p(v)))) and per depth ``pos_drafted_i``, ``pos_tested_i``, ``pos_accepted_i``.
    """

    def __init__(
        self,
        p_next: NextDist,
        q_next: NextDist,
        prompt: Sequence[int],
        max_new_tokens: int,
        gamma: int,
        eos: Iterable[int] = (),
        lenience: str | None = None,
        eps: float = 1.0,
        mutation: str | None = None,
        confidence_threshold: float = 0.0,
        lookup: tuple[int, int, int] | None = None,
    ) -> None:
        if mutation not in MUTATIONS:
            raise ValueError(f"unknown mutation {mutation!r}")
        self.p_next = lambda prefix: p_next(prefix).tolist()
        self.q_next = lambda prefix: q_next(prefix).tolist()
        self.prompt = tuple(prompt)
        self.limit = len(prompt) + max_new_tokens
        self.max_new_tokens = max_new_tokens
        self.gamma = gamma
        self.eos = frozenset(eos)
        self.f = lenience_fn(lenience, eps)
        self.scale = {"accept_x0.9": 0.9, "accept_x0.97": 0.97}.get(mutation, 1.0)
        self.mutation = mutation
        self.threshold = confidence_threshold
        self.lookup = lookup
        self._blocks: dict = {}
        self._dist: dict = {}
        self._exp: dict = {}

    def block(self, seq: tuple[int, ...]) -> list[tuple[float, tuple[int, ...], bool, dict[str, float]]]:
        """Every outcome of one block after ``seq``: (probability, emitted tokens, finished, counts)."""
        if seq in self._blocks:
            return self._blocks[seq]
        room = self.limit - len(seq) - 1
        out: list = []
        if self.lookup is not None and room > 0:
            num_tokens, max_ngram, min_ngram = self.lookup
            copied = copied_draft(seq, min(num_tokens, room), max_ngram, min_ngram, self.eos)
            if copied:
                vocab = len(self.p_next(seq))
                points = [[1.0 if v == x else 0.0 for v in range(vocab)] for x in copied]
                self._verify(seq, copied, 1.0, points, out, drafter_calls=0)
                self._blocks[seq] = out
                return out
        budget = min(self.gamma, room)
        stack: list = [((), 1.0, [])]
        while stack:
            draft, dprob, qs = stack.pop()
            stopped = bool(draft) and (draft[-1] in self.eos or qs[-1][draft[-1]] < self.threshold)
            if len(draft) < budget and not stopped:
                q = self.q_next(seq + draft)
                for x, qx in enumerate(q):
                    if qx > 0:
                        stack.append((draft + (x,), dprob * qx, qs + [q]))
                continue
            self._verify(seq, draft, dprob, qs, out)
        self._blocks[seq] = out
        return out

    def _verify(self, seq, draft, dprob, qs, out, drafter_calls: int | None = None) -> None:
        k = len(draft)
        f = self.f
        ps = [self.p_next(seq + draft[:i]) for i in range(k + 1)]
        alphas = [min(1.0, self.scale * f(ps[i][draft[i]]) / qs[i][draft[i]]) for i in range(k)]
        expected_pos = [sum(min(qv, f(pv)) for qv, pv in zip(qs[i], ps[i], strict=True)) for i in range(k)]
        reach = 1.0
        for n in range(k + 1):
            p_n = reach * (1.0 - alphas[n]) if n < k else reach
            if n < k:
                reach *= alphas[n]
            if p_n <= 0.0:
                continue
            tested = min(n + 1, k)
            c = {
                "verifier_calls": 1.0,
                "drafter_calls": float(k if drafter_calls is None else drafter_calls),
                "lookup_blocks": 0.0 if drafter_calls is None else 1.0,
                "drafted": float(k),
                "accepted": float(n),
                "tested": float(tested),
                "sum_expected": sum(expected_pos[:tested]),
            }
            for i in range(k):
                c[f"pos_drafted_{i}"] = 1.0
            for i in range(tested):
                c[f"pos_tested_{i}"] = 1.0
            for i in range(n):
                c[f"pos_accepted_{i}"] = 1.0
            accepted = draft[:n]
            if n == k and k and draft[-1] in self.eos:  # an accepted EOS: no bonus token
                self._emit(seq, accepted, dprob * p_n, c, out)
                continue
            if n < k and self.mutation != "residual_from_p":
                r = [max(0.0, pv - qv) for pv, qv in zip(ps[n], qs[n], strict=True)]
                total = sum(r)
                nd = [x / total for x in r] if total > 0 else ps[n]
            else:
                nd = ps[n]
            for y, py in enumerate(nd):
                if py > 0:
                    self._emit(seq, accepted + (y,), dprob * p_n * py, c, out)

    def _emit(self, seq, new, prob, counts, out) -> None:
        done = False
        for j, x in enumerate(new):
            if x in self.eos:
                new, done = new[: j + 1], True
                break
        room = self.limit - len(seq)
        if len(new) >= room:
            new, done = new[:room], True
        out.append((prob, new, done, counts))

    def distribution(self, seq: tuple[int, ...] | None = None) -> dict[tuple[int, ...], float]:
        """{tokens emitted after ``seq`` (default: the prompt): probability}."""
        seq = self.prompt if seq is None else seq
        if self.max_new_tokens == 0:
            return {(): 1.0}
        if seq not in self._dist:
            dist: dict[tuple[int, ...], float] = {}
            for prob, new, done, _ in self.block(seq):
                tails = {(): 1.0} if done else self.distribution(seq + new)
                for tail, pt in tails.items():
                    dist[new + tail] = dist.get(new + tail, 0.0) + prob * pt
            self._dist[seq] = dist
        return self._dist[seq]

    def expectations(self, seq: tuple[int, ...] | None = None) -> dict[str, float]:
        """{count name: its expectation over one ``generate``} (see the class docstring)."""
        seq = self.prompt if seq is None else seq
        if self.max_new_tokens == 0:
            return {}
        if seq not in self._exp:
            exp: dict[str, float] = {}
            for prob, new, done, counts in self.block(seq):
                for key, v in counts.items():
                    exp[key] = exp.get(key, 0.0) + prob * v
                exp["new_tokens"] = exp.get("new_tokens", 0.0) + prob * len(new)
                if not done:
                    for key, v in self.expectations(seq + new).items():
                        exp[key] = exp.get(key, 0.0) + prob * v
            self._exp[seq] = exp
        return self._exp[seq]


def verifier_joint(
    p_next: NextDist, prompt: Sequence[int], max_new_tokens: int, eos: Iterable[int] = ()
) -> dict[tuple[int, ...], float]:
    """The verifier's own sampled continuation: {tokens: probability}, EOS (included) ends it."""
    eos = frozenset(eos)
    out: dict[tuple[int, ...], float] = {}

    def rec(seq: tuple[int, ...], prob: float) -> None:
        new = seq[len(prompt) :]
        if len(new) == max_new_tokens or (new and new[-1] in eos):
            out[new] = out.get(new, 0.0) + prob
            return
        p = p_next(seq)
        for y in torch.nonzero(p > 0).flatten().tolist():
            rec(seq + (y,), prob * float(p[y]))

    rec(tuple(prompt), 1.0)
    return out


# ---------------------------------------------------------------- chi-square with a stated power


def pooled_cells(probs: dict, n: int, min_expected: float = 5.0) -> list[list]:
    """Group outcome keys into cells with expected count >= ``min_expected`` (small ones pooled)."""
    cells, small, small_mass = [], [], 0.0
    for key, p in sorted(probs.items(), key=lambda kv: -kv[1]):
        if n * p >= min_expected:
            cells.append([key])
        else:
            small.append(key)
            small_mass += p
    if small:
        if n * small_mass >= min_expected or not cells:
            cells.append(small)
        else:
            cells[-1].extend(small)
    return cells


def chi_square(counts: dict, probs: dict, n: int) -> tuple[float, int]:
    """Pearson chi-square of observed ``counts`` against ``probs`` (n draws), pooled cells; (stat, df).

    Any observed key with zero probability fails immediately (an impossible output)."""
    impossible = [k for k in counts if probs.get(k, 0.0) <= 0.0]
    assert not impossible, f"outputs with zero probability were emitted: {impossible[:5]}"
    cells = pooled_cells(probs, n)
    stat = 0.0
    for cell in cells:
        e = n * sum(probs[k] for k in cell)
        o = sum(counts.get(k, 0) for k in cell)
        stat += (o - e) ** 2 / e
    return stat, max(len(cells) - 1, 1)


def noncentrality(probs: dict, alt: dict, n: int) -> float:
    """lambda = n * sum_cells (alt - probs)^2 / probs over the same pooled cells as :func:`chi_square`."""
    lam = 0.0
    for cell in pooled_cells(probs, n):
        e = sum(probs[k] for k in cell)
        a = sum(alt.get(k, 0.0) for k in cell)
        lam += n * (a - e) ** 2 / e
    return lam


ALPHA = 1e-4


def _chi2_sf(x: float, df: float) -> float:
    """P(chi-square(df) > x), Wilson-Hilferty approximation (accurate to a few % of the tail here)."""
    if x <= 0:
        return 1.0
    z = ((x / df) ** (1 / 3) - (1 - 2 / (9 * df))) / math.sqrt(2 / (9 * df))
    return 0.5 * math.erfc(z / math.sqrt(2))


def chi2_critical(df: int, alpha: float = ALPHA) -> float:
    """Upper ``alpha`` quantile of chi-square(df) (Wilson-Hilferty)."""
    z = NormalDist().inv_cdf(1 - alpha)
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def chi2_power(df: int, lam: float, alpha: float = ALPHA) -> float:
    """P(reject) of the level-``alpha`` chi-square test when the truth has noncentrality ``lam``.

    Patnaik's approximation: noncentral chi-square(df, lam) ~ c * chi-square(h) with
    c = (df + 2 lam) / (df + lam), h = (df + lam)^2 / (df + 2 lam).
    """
    c = (df + 2 * lam) / (df + lam)
    h = (df + lam) ** 2 / (df + 2 * lam)
    return _chi2_sf(chi2_critical(df, alpha) / c, h)


def mean_power(shift: float, se: float, z: float = 4.5) -> float:
    """P(|estimate - reference| > z se) when the estimate is off by ``shift`` (normal approximation)."""
    d = abs(shift) / se
    return NormalDist().cdf(d - z) + NormalDist().cdf(-d - z)


# ---------------------------------------------------------------- fakes and sampling drivers


def peaked_table_lm(
    vocab: int,
    seed: int,
    dominant: float,
    eos_logit: float,
    positions: int = 3,
    jitter: float = 0.4,
    pos_jitter: float | None = None,
):
    """A ``TableLM`` whose next token is usually the successor of the current one (cyclically over the
    non-EOS ids, logit + ``dominant``); the last id is the EOS, with logit offset ``eos_logit``.

    A verifier and a drafter built with different ``dominant`` / ``eos_logit`` agree often (acceptance
    ~ 0.9) without being equal: the regime where rejections are rare, so a biased acceptance rule
    changes the rejection rate, and with it the output distribution, by a large relative amount.
    ``pos_jitter`` (default ``jitter``) scales the position-dependent part: large values make the
    distribution depend strongly on the absolute position, so a cache of the wrong length shows.
    """
    from .decoding_helpers import TableLM

    g = torch.Generator().manual_seed(seed)
    table = torch.randn(vocab, vocab, generator=g) * jitter
    for row in range(vocab):
        table[row, (row + 1) % (vocab - 1)] += dominant
    table[:, vocab - 1] += eos_logit
    pos_bias = torch.randn(positions, vocab, generator=g) * (jitter if pos_jitter is None else pos_jitter)
    return TableLM(table, pos_bias)


@dataclass
class Runs:
    """``n`` independent ``generate`` calls: output counts and each call's stats."""

    n: int
    counts: dict[tuple[int, ...], int]
    stats: list


def run_many(
    decoder, prompt: Sequence[int], max_new_tokens: int, params, n: int, seed: int, eos=None
) -> Runs:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.tensor([list(prompt)])
    counts: dict[tuple[int, ...], int] = {}
    stats = []
    for _ in range(n):
        res = decoder.generate(ids, max_new_tokens, params, eos_token_id=eos, generator=gen)
        key = tuple(res.tokens.tolist())
        counts[key] = counts.get(key, 0) + 1
        stats.append(res.stats)
    return Runs(n, counts, stats)


def per_run(runs: Runs, name: str) -> list[float]:
    """One count per run: a DecodeStats field, or ``pos_<field>_<i>`` for depth i of a position list."""
    if name.startswith("pos_"):
        field_name, depth = name[4:].rsplit("_", 1)
        i = int(depth)
        out = []
        for s in runs.stats:
            lst = getattr(s, f"position_{field_name}")
            out.append(float(lst[i]) if i < len(lst) else 0.0)
        return out
    key = "sum_expected_acceptance" if name == "sum_expected" else name
    return [float(getattr(s, key)) for s in runs.stats]


def mean_and_se(values: Sequence[float]) -> tuple[float, float]:
    n = len(values)
    m = sum(values) / n
    var = sum((v - m) ** 2 for v in values) / max(n - 1, 1)
    return m, math.sqrt(var / n)
