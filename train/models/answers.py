"""The verifier's own answers to prompts, with its top-k distribution at every answer token.

A drafter is judged by how often it guesses what the verifier will say, so the data that teaches it
most is the verifier's own output on in-domain prompts. :func:`generate_answers` produces it in
batches (prompts sorted by length so little padding is computed) and keeps, for each answer token,
the verifier's ``top_logprobs`` largest log-probabilities: enough to distil the distribution (the greedy
token is its first entry) at ``top_logprobs / vocabulary`` of the memory of full logits. They are taken
as each step's logits are produced (:class:`TopKRecorder`), so no step's full-vocabulary logits outlive
it: a batch of 32 answers of 128 tokens over 49,152 ids would otherwise hold 0.8 GB of float32 logits.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import LogitsProcessor, LogitsProcessorList

from train.data.lm import collate_left_pad
from train.renames import renamed_keywords


@dataclass
class Answer:
    """One prompt and the verifier's answer. ``top_ids`` / ``top_logprobs``: ``(len(answer), k)``, the
    verifier's k most likely tokens (descending) at each answer position and their log-probabilities."""

    prompt: list[int]
    answer: list[int]
    top_ids: torch.Tensor
    top_logprobs: torch.Tensor

    def to_dict(self) -> dict[str, Any]:
        return {
            "prompt": self.prompt,
            "answer": self.answer,
            "top_ids": self.top_ids,
            "top_logprobs": self.top_logprobs,
        }


class TopKRecorder(LogitsProcessor):
    """Keeps the ``k`` largest log-probabilities of the logits it is shown at each generation step and
    passes the logits on unchanged. ``generate`` runs it after its own processors; with the settings
    :func:`generate_answers` uses (greedy, or sampling at T = 1 with no top-k / top-p) there are none, so
    it sees the model's raw logits."""

    def __init__(self, k: int) -> None:
        self.k = k
        self.values: list[torch.Tensor] = []
        self.indices: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        top = torch.log_softmax(scores.float(), dim=-1).topk(self.k, dim=-1)
        self.values.append(top.values)
        self.indices.append(top.indices)
        return scores

    def stacked(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(B, steps, k)`` log-probabilities and ids, on the CPU."""
        return torch.stack(self.values, dim=1).cpu(), torch.stack(self.indices, dim=1).cpu()


def answer_length(tokens: torch.Tensor, eos_ids: Sequence[int]) -> int:
    """Tokens of one generated row up to and including its first eos (all of them without one)."""
    hits = torch.isin(tokens, torch.tensor(list(eos_ids), device=tokens.device)).nonzero()
    return int(hits[0, 0]) + 1 if len(hits) else int(tokens.numel())


# more than 8 parameters: a generation request as transformers' generate takes it
@renamed_keywords(top_k="top_logprobs")
@torch.inference_mode()
def generate_answers(
    verifier: Any,
    prompts: Sequence[Sequence[int]],
    eos_ids: Sequence[int],
    max_new_tokens: int,
    batch_size: int = 16,
    top_logprobs: int = 16,
    temperature: float = 0.0,
    seed: int = 0,
    on_batch: Callable[[int], None] | None = None,
) -> list[Answer]:
    """The verifier's answer to every prompt (greedy at ``temperature`` 0, else sampled), in the order
    of ``prompts``. ``on_batch(n)`` is told after each batch how many prompts it answered."""
    device = next(verifier.parameters()).device
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    answers: dict[int, Answer] = {}
    torch.manual_seed(seed)
    for start in range(0, len(order), batch_size):
        chunk = order[start : start + batch_size]
        padded = collate_left_pad([prompts[i] for i in chunk], pad_id=int(eos_ids[0]))
        ids, mask = padded["input_ids"], padded["attention_mask"]
        sampling: dict[str, Any] = {"do_sample": False}
        if temperature > 0:
            sampling = {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}
        recorder = TopKRecorder(top_logprobs)
        sequences = verifier.generate(
            input_ids=ids.to(device),
            attention_mask=mask.to(device),
            max_new_tokens=max_new_tokens,
            eos_token_id=list(eos_ids),
            pad_token_id=int(eos_ids[0]),
            logits_processor=LogitsProcessorList([recorder]),
            **sampling,
        )
        generated = sequences[:, ids.shape[1] :].cpu()
        kept_logprobs, kept_ids = recorder.stacked()
        for row, index in enumerate(chunk):
            n = answer_length(generated[row], eos_ids)
            answers[index] = Answer(
                prompt=list(prompts[index]),
                answer=generated[row, :n].tolist(),
                top_ids=kept_ids[row, :n].to(torch.int32).clone(),
                top_logprobs=kept_logprobs[row, :n].to(torch.float16).clone(),
            )
        if on_batch is not None:
            on_batch(len(chunk))
    return [answers[i] for i in range(len(prompts))]


def save_answers(answers: Sequence[Answer], path: str) -> None:
    torch.save([a.to_dict() for a in answers], path)


def load_answers(path: str) -> list[Answer]:
    return [Answer(**row) for row in torch.load(path, weights_only=True)]
