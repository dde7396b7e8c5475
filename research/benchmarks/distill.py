"""On-policy distillation throughput: our DistillSpec step against TRL's ``GKDTrainer``.

``python scripts/bench.py distill``. Both sides train the same drafter towards the same frozen verifier,
fully on-policy (lmbda = 1: every batch is sampled from the current drafter), with the same prompts,
batch size, ``max_new_tokens``, sampling temperature, loss (generalised JSD, beta 0.5), optimizer
(AdamW, same lr) and torch thread count:

- ``ours``: :class:`~train.methods.distillspec.module.DistillSpecModule` under a ``lightning.Trainer``
  (batched KV-cache rollouts from :mod:`train.training.rollout`, logits only over the continuation,
  the chunked fused-gradient divergence of :mod:`train.losses`);
- ``trl``: ``trl.experimental.gkd.GKDTrainer`` (``model.generate`` rollouts, full-sequence logits,
  ``generalized_jsd_loss``) under the Hugging Face ``Trainer``.

Throughput is *continuation tokens per second*: generated tokens that enter the loss (up to and
including EOS) divided by the wall time of the timed optimizer steps (the first ``--warmup`` steps
are not timed). Each side runs in its own subprocess so that memory figures do not mix: ``peak_rss_mb``
is the process's peak resident set size (``resource.getrusage(RUSAGE_SELF).ru_maxrss``) and
``peak_rss_delta_mb`` that peak minus the RSS measured just before training starts (models, data and
libraries already loaded) -- what training itself adds. tracemalloc is not used: it does not see
torch's tensor allocations.

The pair is the embedded tiny pair when ``checkpoints/tiny`` holds it, else a random-weight pair of the
same shapes (``--random``); prompts come from the embedded corpus (or are random ids for ``--random``).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch

SIDES = ("ours", "trl")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--verifier", default="checkpoints/tiny/verifier")
    parser.add_argument("--drafter", default="checkpoints/tiny/drafter")
    parser.add_argument(
        "--random", action="store_true", help="random-weight tiny-shaped pair, random prompts"
    )
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--steps", type=int, default=8, help="timed optimizer steps per side")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads (both sides)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--side", choices=SIDES, default=None, help="run one side in this process (internal)")
    parser.add_argument("--out", default=None, help="write the results as JSON here")


def _rss_mb() -> float:
    """Current resident set size in MiB (Linux /proc), else the peak so far."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:
        return _peak_rss_mb()


def _peak_rss_mb() -> float:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 1024


def load(args: argparse.Namespace) -> tuple[Any, Any, Any, list[list[int]]]:
    """(verifier frozen, drafter, tokenizer, prompt + ground-truth continuation id lists).

    Each row is ``prompt_len`` prompt tokens then ``max_new_tokens`` continuation tokens; only TRL's
    collator uses the continuation (its ``Trainer`` counts the loss's tokens from the batch's labels).
    """
    from train.models.loading import freeze

    n_prompts = args.batch_size * (args.steps + args.warmup)
    if args.random or not os.path.isdir(args.verifier):
        from transformers import LlamaConfig, LlamaForCausalLM

        tok = _byte_tokenizer()
        common = dict(
            vocab_size=4096,
            max_position_embeddings=512,
            bos_token_id=tok.bos_token_id,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
        )
        torch.manual_seed(args.seed)
        verifier = LlamaForCausalLM(
            LlamaConfig(
                hidden_size=192, num_hidden_layers=4, num_attention_heads=3, intermediate_size=512, **common
            )
        )
        drafter = LlamaForCausalLM(
            LlamaConfig(
                hidden_size=64,
                num_hidden_layers=2,
                num_attention_heads=2,
                intermediate_size=176,
                tie_word_embeddings=True,
                **common,
            )
        )
        g = torch.Generator().manual_seed(args.seed)
        prompts = [
            [tok.bos_token_id] + torch.randint(0, 256, (args.prompt_len - 1,), generator=g).tolist()
            for _ in range(n_prompts)
        ]
        return freeze(verifier), drafter, tok, prompts
    from train.data.lm import make_prompts
    from train.data.sources import DataSourceConfig, load_text_dataset
    from train.models.loading import load_model, load_tokenizer

    tok = load_tokenizer(args.verifier)
    verifier, drafter = (
        freeze(load_model(args.verifier)),  # type: ignore[assignment]
        load_model(args.drafter),  # type: ignore[assignment]
    )
    splits = load_text_dataset(DataSourceConfig(corpus_dir="data/stdlib_corpus"), tok)
    ds = make_prompts(
        splits["train"], tok, args.prompt_len, max_prompts=n_prompts, seed=args.seed, continuation_len=0
    )
    return verifier, drafter, tok, [list(p) for p in ds["input_ids"]]


def _byte_tokenizer() -> Any:
    """256 byte tokens plus BOS/EOS/PAD: enough for random prompts, nothing to download."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    for special in ("<|bos|>", "<|eos|>", "<|pad|>"):
        vocab[special] = len(vocab)
    raw = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    return PreTrainedTokenizerFast(
        tokenizer_object=raw, bos_token="<|bos|>", eos_token="<|eos|>", pad_token="<|pad|>"
    )


class _Clock:
    """Wall time and continuation tokens of the steps after the warm-up."""

    def __init__(self, warmup: int) -> None:
        self.warmup, self.step, self.seconds, self.tokens, self.t0 = warmup, 0, 0.0, 0, 0.0
        self.rss_before = 0.0

    def begin(self) -> None:
        if self.step == 0:
            self.rss_before = _rss_mb()
        self.t0 = time.perf_counter()

    def end(self, tokens: int) -> None:
        if self.step >= self.warmup:
            self.seconds += time.perf_counter() - self.t0
            self.tokens += tokens
        self.step += 1


def run_ours(args: argparse.Namespace) -> dict[str, Any]:
    import lightning as L

    from train.data.lm import collate_left_pad
    from train.methods.distillspec.config import DistillSpecConfig
    from train.methods.distillspec.module import DistillSpecModule

    verifier, drafter, tok, prompts = load(args)
    cfg = DistillSpecConfig(
        optimizer=functools.partial(torch.optim.AdamW, lr=args.lr),
        divergence="jsd",
        beta=0.5,
        data_source="drafter",
        temperature=args.temperature,
        max_new_tokens=args.max_new_tokens,
        prompt_len=args.prompt_len,
        batch_size=args.batch_size,
        num_prompts=len(prompts),
    )
    module = DistillSpecModule(drafter, verifier, tok, cfg, seed=args.seed)
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    loader: Any = torch.utils.data.DataLoader(
        prompts,  # type: ignore[arg-type]
        batch_size=args.batch_size,
        shuffle=False,
        collate_fn=functools.partial(collate_left_pad, pad_id=pad),
    )
    clock = _Clock(args.warmup)

    class Timer(L.Callback):
        def on_train_batch_start(self, *a: Any) -> None:
            clock.begin()

        def on_train_batch_end(self, *a: Any) -> None:
            clock.end(module.last_num_tokens)

    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=args.steps + args.warmup,
        logger=False,
        callbacks=[Timer()],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
    )
    trainer.fit(module, train_dataloaders=loader)
    return _result("ours", clock)


def run_trl(args: argparse.Namespace) -> dict[str, Any]:
    import warnings

    from datasets import Dataset
    from transformers import TrainerCallback

    from train.data.lm import collate_left_pad

    warnings.filterwarnings("ignore")
    from trl.experimental.gkd import GKDConfig, GKDTrainer

    verifier, drafter, tok, prompts = load(args)
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token

    def collate(rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        batch = collate_left_pad([r["input_ids"] for r in rows], pad_id=pad)
        labels = torch.full_like(batch["input_ids"], -100)
        return {
            "prompts": batch["input_ids"],
            "prompt_attention_mask": batch["attention_mask"],
            "input_ids": batch["input_ids"],
            "attention_mask": batch["attention_mask"],
            "labels": labels,
        }

    out_dir = tempfile.mkdtemp(prefix="bench_gkd_")
    gkd_args = GKDConfig(
        output_dir=out_dir,
        per_device_train_batch_size=args.batch_size,
        max_steps=args.steps + args.warmup,
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        lmbda=1.0,
        beta=0.5,
        temperature=args.temperature,
        max_new_tokens=args.max_new_tokens,
        seq_kd=False,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        logging_steps=10_000,
        dataloader_num_workers=0,
        seed=args.seed,
        disable_tqdm=True,
        remove_unused_columns=False,
        max_length=None,
        bf16=False,
        fp16=False,
    )
    trainer = GKDTrainer(
        model=drafter,
        teacher_model=verifier,
        args=gkd_args,
        data_collator=collate,
        train_dataset=Dataset.from_dict({"input_ids": prompts}),
        processing_class=tok,
    )
    # With on-policy batches the Trainer's token count (taken from the collated labels before the rollout
    # replaces them) can be 0 and the loss inf; without it GKD divides by the rollout's own mask count.
    trainer.model_accepts_loss_kwargs = False
    clock = _Clock(args.warmup)
    seen = {"tokens": 0}
    generate = trainer.generate_on_policy_outputs

    def counted(model: Any, inputs: Any, generation_config: Any) -> Any:
        ids, mask, labels = generate(model, inputs, generation_config)
        seen["tokens"] = int((labels != -100).sum())
        return ids, mask, labels

    trainer.generate_on_policy_outputs = counted  # type: ignore[method-assign]

    class Timer(TrainerCallback):
        def on_step_begin(self, *a: Any, **k: Any) -> None:
            clock.begin()

        def on_step_end(self, *a: Any, **k: Any) -> None:
            clock.end(seen["tokens"])

    trainer.add_callback(Timer())
    trainer.train()
    return _result("trl", clock)


def _result(side: str, clock: _Clock) -> dict[str, Any]:
    peak = _peak_rss_mb()
    return {
        "side": side,
        "timed_steps": clock.step - clock.warmup,
        "continuation_tokens": clock.tokens,
        "seconds": clock.seconds,
        "tokens_per_second": clock.tokens / clock.seconds if clock.seconds else float("nan"),
        "peak_rss_mb": peak,
        "peak_rss_delta_mb": peak - clock.rss_before,
    }


def run_side(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    return run_ours(args) if args.side == "ours" else run_trl(args)


def _argv(args: argparse.Namespace, side: str) -> list[str]:
    argv = [sys.executable, "scripts/bench.py", "distill", "--side", side]
    for name in (
        "verifier",
        "drafter",
        "batch_size",
        "max_new_tokens",
        "prompt_len",
        "temperature",
        "steps",
        "warmup",
        "lr",
        "threads",
        "seed",
    ):
        argv += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    return argv + (["--random"] if args.random else [])


def markdown(res: dict[str, Any]) -> str:
    lines = [
        "| side | continuation tokens/s | timed steps | tokens | seconds "
        "| peak RSS MiB | peak RSS delta MiB |",
        "|---|---|---|---|---|---|---|",
    ]
    for side in SIDES:
        r = res[side]
        lines.append(
            f"| {side} | {r['tokens_per_second']:.1f} | {r['timed_steps']} | {r['continuation_tokens']} | "
            f"{r['seconds']:.1f} | {r['peak_rss_mb']:.0f} | {r['peak_rss_delta_mb']:.0f} |"
        )
    lines.append(f"\nthroughput ours / trl = **{res['ratio']:.2f}x**")
    return "\n".join(lines)


def main(args: argparse.Namespace) -> dict[str, Any]:
    if args.side is not None:
        result = run_side(args)
        print("RESULT " + json.dumps(result))
        return result
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    res: dict[str, Any] = {
        "config": {k: v for k, v in vars(args).items() if k not in ("func", "side", "out")}
    }
    for side in SIDES:
        proc = subprocess.run(
            _argv(args, side),
            cwd=root,
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHONPATH": root},
        )
        lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        if proc.returncode != 0 or not lines:
            raise RuntimeError(f"{side} benchmark failed:\n{proc.stderr[-4000:]}")
        res[side] = json.loads(lines[-1][len("RESULT ") :])
    res["ratio"] = res["ours"]["tokens_per_second"] / res["trl"]["tokens_per_second"]
    print(markdown(res))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=2)
    return res
