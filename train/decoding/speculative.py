"""Chain speculative decoding (Leviathan et al. 2023; Chen et al. 2023), ALGORITHMS.md section 1.

One block::

    draft x_1..x_g ~ q (argmax at T=0), stopping early at EOS
    p_1..p_{g+1} = verifier(uncached tokens + x_1..x_g)     # ONE forward pass over a cached prefix
    accept x_i while U < min(1, f(p_i(x_i), eps) / q_i(x_i))  (T=0: x_i == argmax p_i)
    on the first rejection emit a token from norm(max(0, p_i - q_i)) (T=0: argmax p_i) and end the block
    if every draft is accepted: an accepted EOS ends generation, otherwise emit a bonus token ~ p_{g+1}

Cache invariants (batch size 1, both caches are the models' own ``DynamicCache``):

- the verifier cache holds every committed token except the last one; the first block's verifier
  forward is the prompt prefill, so a block costs exactly one verifier call;
- the drafter cache holds a prefix of the committed tokens plus the drafts it was fed; at the start of
  a block it is fed, lazily and in one call, every committed token it has not seen (the previous
  block's correction/bonus token, and the last accepted draft, which a drafter never consumes);
- on rejection both caches are cropped back to the accepted prefix. Nothing is re-encoded.

The draft length of a block is ``min(gamma, tokens still allowed - 1)`` (as in Hugging Face assisted
generation), so a block never overshoots ``max_new_tokens``; this changes no output distribution.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

import torch

from ._common import eos_set, model_device, output_vocab_size, supports_logits_to_keep, validate_request
from .metrics import DecodeResult, DecodeStats
from .sampling import LENIENCES, SamplingParams, accept_draft, first_rejection, residual, warp

_DEFAULT_PARAMS = SamplingParams()


def _crop(cache: object, current: int, keep: int) -> None:
    """Drop the last ``current - keep`` positions of a cache (``crop`` takes a negative count to remove)."""
    if keep < current:
        cache.crop(keep - current)  # type: ignore[attr-defined]


class SpeculativeDecoder:
    """Chain speculative decoding of ``verifier`` with ``drafter`` proposing ``gamma`` tokens per block.

    ``lenience`` (``"linear"``, ``"squared"``, ``"exponential"`` or None) with ``eps`` in (0, 1] gives
    the lossy DistillSpec acceptance test min(1, f(p, eps) / q); eps = 1 is lossless. Lenience only
    applies when sampling (temperature > 0); greedy decoding always reproduces the verifier's argmax.

    Verifier and drafter must share a tokenizer. When their output sizes differ (padded embeddings)
    both logits are sliced to the common vocabulary ``min(V_verifier, V_drafter)``; tokens beyond it
    are never drafted nor emitted.
    """

    def __init__(
        self,
        verifier: torch.nn.Module,
        drafter: torch.nn.Module,
        gamma: int = 4,
        lenience: str | None = None,
        eps: float = 1.0,
    ) -> None:
        if isinstance(gamma, bool) or not isinstance(gamma, int) or gamma < 1:
            raise ValueError(f"gamma must be an integer >= 1, got {gamma!r}")
        if lenience is not None and lenience not in LENIENCES:
            raise ValueError(f"lenience must be one of {sorted(LENIENCES)} or None, got {lenience!r}")
        if not 0.0 < eps <= 1.0:
            raise ValueError(f"eps must be in the range (0, 1] (1 = lossless), got {eps!r}")
        self.verifier = verifier
        self.drafter = drafter
        self.gamma = gamma
        self.lenience = lenience if eps != 1.0 else None
        self.eps = float(eps)
        self.vocab_size = min(output_vocab_size(verifier), output_vocab_size(drafter))
        self._v_keep = supports_logits_to_keep(verifier)
        self._d_keep = supports_logits_to_keep(drafter)

    @torch.inference_mode()
    def generate(
        self,
        input_ids: torch.Tensor,
        max_new_tokens: int,
        params: SamplingParams = _DEFAULT_PARAMS,
        eos_token_id: int | Iterable[int] | None = None,
        generator: torch.Generator | None = None,
    ) -> DecodeResult:
        """Generate up to ``max_new_tokens`` tokens after ``input_ids`` (1, T); see the module docstring.

        Returns the new tokens only (1-D, on CPU), stopping after the first EOS (included).
        ``max_new_tokens == 0`` returns an empty tensor and zero counts without running either model.
        """
        t_start = time.perf_counter()
        prompt = validate_request(input_ids, max_new_tokens, params, (self.verifier, self.drafter))
        gamma = self.gamma
        stats = DecodeStats(gamma=gamma)
        verifier, drafter = self.verifier, self.drafter
        v_dev, d_dev = model_device(verifier), model_device(drafter)
        sync = v_dev.type == "cuda" or d_dev.type == "cuda"
        eos = eos_set(eos_token_id)
        greedy = params.temperature == 0.0
        lenience, eps = self.lenience, self.eps
        vocab = self.vocab_size
        d_kw = {"logits_to_keep": 1} if self._d_keep else {}
        v_keep = self._v_keep
        perf = time.perf_counter
        long = torch.long

        seq = list(prompt)
        limit = len(prompt) + max_new_tokens
        v_len = d_len = 0  # positions held by each cache
        v_cache = d_cache = None
        pos_drafted, pos_tested, pos_accepted = (
            stats.position_drafted,
            stats.position_tested,
            stats.position_accepted,
        )
        drafted = accepted = tested = v_calls = d_calls = 0
        sum_ea = 0.0
        d_time = v_time = 0.0
        done = max_new_tokens == 0

        while not done:
            n_seq = len(seq)
            g = min(gamma, limit - n_seq - 1)
            drafts: list[int] = []
            qs: list[torch.Tensor] = []
            # ---- draft: feed the drafter every committed token it has not seen, then its own drafts
            if g > 0:
                feed = seq[d_len:]
                for _ in range(g):
                    ids = torch.tensor([feed], dtype=long, device=d_dev)
                    t0 = perf()
                    out = drafter(input_ids=ids, past_key_values=d_cache, use_cache=True, **d_kw)
                    if sync:
                        torch.cuda.synchronize()
                    d_time += perf() - t0
                    d_cache = out.past_key_values
                    d_len += len(feed)
                    logits = out.logits[0, -1, :vocab]
                    if greedy:
                        x = int(logits.argmax())
                    else:
                        q = warp(logits, params)
                        x = int(torch.multinomial(q, 1, generator=generator))
                        qs.append(q)
                    drafts.append(x)
                    if x in eos:
                        break
                    feed = [x]
                d_calls += len(drafts)
            k = len(drafts)
            # ---- verify: one forward over the uncached committed token(s) and the drafts
            ids = torch.tensor([seq[v_len:] + drafts], dtype=long, device=v_dev)
            t0 = perf()
            if v_keep:
                out = verifier(input_ids=ids, past_key_values=v_cache, use_cache=True, logits_to_keep=k + 1)
            else:
                out = verifier(input_ids=ids, past_key_values=v_cache, use_cache=True)
            if sync:
                torch.cuda.synchronize()
            v_time += perf() - t0
            v_calls += 1
            v_cache = out.past_key_values
            v_len += ids.shape[1]
            v_logits = out.logits[0, -(k + 1) :, :vocab]
            # ---- accept / reject
            if greedy:
                targets = v_logits.argmax(dim=-1).tolist()
                n = 0
                while n < k and drafts[n] == targets[n]:
                    n += 1
                sum_ea += n
                last = targets[n] if n < k or not (k and drafts[-1] in eos) else None
            else:
                p = warp(v_logits, params)  # (k + 1, V)
                n = 0
                if k:
                    q_all = torch.stack(qs).to(p.device)  # (k, V)
                    rows = torch.arange(k, device=p.device)
                    cols = torch.tensor(drafts, dtype=long, device=p.device)
                    u = torch.rand(k, generator=generator, device=p.device)
                    acc = accept_draft(p[rows, cols], q_all[rows, cols], u, lenience, eps)
                    n = first_rejection(acc)
                    t = min(n + 1, k)
                    sum_ea += float(torch.minimum(p[:t], q_all[:t]).sum())
                if n < k:
                    last = int(torch.multinomial(residual(p[n], q_all[n]), 1, generator=generator))
                elif k and drafts[-1] in eos:
                    last = None  # an accepted EOS ends generation: no bonus token
                else:
                    last = int(torch.multinomial(p[k], 1, generator=generator))
            # ---- bookkeeping
            t = min(n + 1, k)
            drafted += k
            accepted += n
            tested += t
            for i in range(k):
                pos_drafted[i] += 1
            for i in range(t):
                pos_tested[i] += 1
            for i in range(n):
                pos_accepted[i] += 1
            new = drafts[:n]
            if last is not None:
                new.append(last)
            if eos:
                for j, x in enumerate(new):
                    if x in eos:
                        new = new[: j + 1]
                        done = True
                        break
            room = limit - n_seq
            if len(new) >= room:
                new = new[:room]
                done = True
            seq.extend(new)
            if done:
                break
            # ---- crop both caches to the accepted prefix (the last emitted token stays uncached)
            keep = n_seq + n
            _crop(v_cache, v_len, keep)
            v_len = min(v_len, keep)
            if d_len > keep:
                _crop(d_cache, d_len, keep)
                d_len = keep

        stats.drafted, stats.accepted, stats.tested = drafted, accepted, tested
        stats.verifier_calls, stats.drafter_calls = v_calls, d_calls
        stats.sum_expected_acceptance = sum_ea
        stats.drafter_time, stats.verifier_time = d_time, v_time
        stats.new_tokens = len(seq) - len(prompt)
        stats.wall_time = time.perf_counter() - t_start
        return DecodeResult(torch.tensor(seq[len(prompt) :], dtype=torch.long), stats)
