"""The vLLM side of serving and answer generation: run by the Python of an environment with vLLM installed.

``python train/vllm/worker.py JOB.json RESULT.json``. vLLM pins its own transformers, so it
usually lives in its own environment (``.venv-vllm``, docs/serving.md) where this package is not
installed: this file imports nothing from ``train`` and nothing outside the standard library but vLLM.
The project's side (:mod:`train.vllm.run`) writes the job and reads the result.

The job (JSON): ``model``, ``dtype``, ``max_model_len``, ``seed``, ``speculative_config`` (null: the
verifier alone), ``prompts`` (token id lists), ``max_new_tokens``, ``temperature``, ``stop_token_ids``,
``mode``:

- ``decode``: one untimed warm-up generation, then every prompt alone (batch 1, the latency a user
  of speculative decoding buys) timed one by one; then all prompts in one batch, timed (throughput).
  The speculative counters (``vllm:spec_decode_*``) are read before and after the per-prompt pass,
  so the figures are those prompts' alone.
- ``answers``: all prompts in one call, ``n`` samples each, with the ``logprobs`` most likely tokens'
  raw log-probabilities (before temperature) at every generated position.

The result (JSON): ``vllm_version``, ``startup_seconds``, and per mode ``outputs`` / ``seconds`` /
``batch_seconds`` / ``spec`` (counter deltas), or ``answers`` (``[[{"tokens", "top_ids",
"top_logprobs"}] per sample] per prompt``) and the ``request_seed`` the sampling used (:func:`request_seed`).
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

SPEC_COUNTERS = {
    "vllm:spec_decode_num_drafts": "num_drafts",
    "vllm:spec_decode_num_draft_tokens": "num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "num_accepted_tokens",
}
SPEC_PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos"


def spec_counters(metrics: list[Any]) -> dict[str, Any]:
    """vLLM's speculative-decoding counters, summed over engines: ``num_drafts``, ``num_draft_tokens``,
    ``num_accepted_tokens`` and ``accepted_per_position`` (drafts whose i-th token was accepted)."""
    out: dict[str, Any] = {key: 0 for key in SPEC_COUNTERS.values()}
    per_position: list[int] = []
    for metric in metrics:
        if metric.name in SPEC_COUNTERS:
            out[SPEC_COUNTERS[metric.name]] += int(metric.value)
        elif metric.name == SPEC_PER_POSITION:
            values = [int(v) for v in metric.values]
            per_position = [a + b for a, b in zip(per_position, values, strict=False)] or values
    out["accepted_per_position"] = per_position
    return out


def counter_delta(after: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
    delta = {key: after[key] - before[key] for key in SPEC_COUNTERS.values()}
    base = before["accepted_per_position"] or [0] * len(after["accepted_per_position"])
    delta["accepted_per_position"] = [
        a - b for a, b in zip(after["accepted_per_position"], base, strict=True)
    ]
    return delta


def _eager(job: dict[str, Any]) -> bool:
    """``enforce_eager`` unless the job says: on the CPU eager (torch.compile's warm-up costs more than it
    buys there; docs/serving.md), on GPUs not (CUDA graphs are most of vLLM's decode speed)."""
    if job.get("enforce_eager") is not None:
        return bool(job["enforce_eager"])
    import torch

    return not torch.cuda.is_available()


def request_seed(job: dict[str, Any], cuda: bool | None = None) -> int | None:
    """The per-request seed of the job's sampling: the job's ``seed``; None (the engine's seed alone) for
    sampled generation without CUDA, where vLLM's CPU sampler refuses a per-request seed ("CPU Generator
    does not use offset"). ``cuda``: whether CUDA is available (default: ask torch)."""
    if job.get("temperature", 0.0) > 0:
        if cuda is None:
            import torch

            cuda = torch.cuda.is_available()
        if not cuda:
            return None
    return int(job.get("seed", 0))


def engine_in_process(job: dict[str, Any], cuda: bool | None = None) -> bool:
    """Whether the engine core runs in this process: for sampled jobs seeded by the engine alone (CPU,
    :func:`request_seed`). There the sampled tokens depend on which requests share a step, and with the core
    in its own process that depends on when each request reaches it (two runs of one job gave two answer
    sets); in this process every request is queued before the first step, so the batches, the draws and
    the answers are the same each run."""
    return job.get("temperature", 0.0) > 0 and request_seed(job, cuda) is None


def _engine(job: dict[str, Any]) -> Any:
    if engine_in_process(job):
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM

    kwargs: dict[str, Any] = {
        "model": job["model"],
        "tokenizer": job.get("tokenizer") or job["model"],
        "dtype": job["dtype"],
        "max_model_len": job["max_model_len"],
        "seed": job.get("seed", 0),
        "enforce_eager": _eager(job),
        "disable_log_stats": False,
    }
    if job.get("speculative_config"):
        kwargs["speculative_config"] = job["speculative_config"]
    if job.get("gpu_memory_utilization"):
        kwargs["gpu_memory_utilization"] = job["gpu_memory_utilization"]
    return LLM(**kwargs)


def _decode(llm: Any, job: dict[str, Any]) -> dict[str, Any]:
    from vllm import SamplingParams

    params = SamplingParams(
        temperature=job.get("temperature", 0.0),
        max_tokens=job["max_new_tokens"],
        stop_token_ids=job.get("stop_token_ids") or None,
        seed=request_seed(job),
    )
    prompts = [{"prompt_token_ids": ids} for ids in job["prompts"]]
    llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)  # warm-up
    before = spec_counters(llm.get_metrics())
    outputs, seconds = [], []
    for prompt in prompts:
        start = time.perf_counter()
        (result,) = llm.generate([prompt], params, use_tqdm=False)
        seconds.append(time.perf_counter() - start)
        outputs.append(list(result.outputs[0].token_ids))
    spec = counter_delta(spec_counters(llm.get_metrics()), before)
    start = time.perf_counter()
    batch = llm.generate(prompts, params, use_tqdm=False)
    batch_seconds = time.perf_counter() - start
    return {
        "outputs": outputs,
        "seconds": seconds,
        "spec": spec,
        "batch_seconds": batch_seconds,
        "batch_tokens": sum(len(r.outputs[0].token_ids) for r in batch),
    }


def _top(position: dict[int, Any], k: int) -> tuple[list[int], list[float]]:
    ranked = sorted(position.items(), key=lambda item: item[1].rank)[:k]
    return [int(token) for token, _ in ranked], [float(lp.logprob) for _, lp in ranked]


def _answers(llm: Any, job: dict[str, Any]) -> dict[str, Any]:
    from vllm import SamplingParams

    k = int(job["logprobs"])
    params = SamplingParams(
        n=int(job.get("n", 1)),
        temperature=job.get("temperature", 0.0),
        max_tokens=job["max_new_tokens"],
        stop_token_ids=job.get("stop_token_ids") or None,
        seed=request_seed(job),
        logprobs=k,
    )
    start = time.perf_counter()
    results = llm.generate([{"prompt_token_ids": ids} for ids in job["prompts"]], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    answers = []
    for result in results:
        samples = []
        for sample in result.outputs:
            tops = [_top(position, k) for position in sample.logprobs or []]
            samples.append(
                {
                    "tokens": list(sample.token_ids),
                    "top_ids": [ids for ids, _ in tops],
                    "top_logprobs": [lps for _, lps in tops],
                }
            )
        answers.append(samples)
    return {"answers": answers, "seconds": seconds, "request_seed": request_seed(job)}


def main(job_path: str, result_path: str) -> None:
    import vllm

    with open(job_path, encoding="utf-8") as f:
        job = json.load(f)
    start = time.perf_counter()
    llm = _engine(job)
    result: dict[str, Any] = {
        "vllm_version": vllm.__version__,
        "startup_seconds": time.perf_counter() - start,
    }
    result.update(_answers(llm, job) if job.get("mode") == "answers" else _decode(llm, job))
    with open(result_path, "w", encoding="utf-8") as f:
        json.dump(result, f)


if __name__ == "__main__":  # vLLM's engine starts worker processes: the guard is required
    main(sys.argv[1], sys.argv[2])
