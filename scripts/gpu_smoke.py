"""GPU smoke run: every method for a few steps on one GPU in bf16, every method under FSDP on the GPUs
present, and the evaluator on CUDA, on a micro pair (built in seconds), then one table of what ran.

    python scripts/gpu_smoke.py             # on a machine with CUDA; exits 1 if any stage failed
    python scripts/gpu_smoke.py --dry-run   # print the commands it would run (any machine)

Each stage is the command a user would type (``python train.py ... trainer=gpu``), run in its own
process under a scratch ``DRAFTSMITH_ROOT``, so nothing lands in the checkout. The bf16 stages load the
pair in bfloat16 under ``bf16-mixed``, as a real pair (``model=qwen3``) trains: float32 trainables beside
a bfloat16 verifier. The FSDP stages run on every GPU present (one is enough for FSDP's precision
plugin and the sharded-gradient clipping); Medusa-2 loads the pair in float32 there (docs/scale.md).
A stage passes when its command exits 0 and every evaluation it wrote (``results.json``) ran on CUDA:
a training run's finish step on the device it trained on, ``scripts/evaluate.py`` on ``device=cuda``.
The tests marked ``gpu`` run the same stages (tests/decoding/test_decoding_gpu.py).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

REPO = Path(__file__).resolve().parents[1]

MICRO_PAIR = [
    "model.tiny.vocab_size=300",
    "model.tiny.seq_len=64",
    "model.tiny.val_blocks=2",
    *(
        f"model.tiny.{role}.{kv}"
        for role, h in (("verifier", 64), ("drafter", 32))
        for kv in f"hidden_size={h},num_layers=2,num_heads=2,intermediate_size=128,max_steps=20".split(",")
    ),
]
MICRO_EVAL = [
    "eval.num_prompts=2",
    "eval.max_new_tokens=16",
    "eval.seeds=[0]",
    "eval.plots=false",
    "eval.progress=false",
]
MICRO_RUN = [
    "trainer.max_steps=4",
    "trainer.val_check_interval=4",
    "trainer.limit_val_batches=1",
    "method.batch_size=4",
    "logger=csv",
    *MICRO_EVAL,
]
METHODS = ("distillspec", "medusa", "medusa2", "steering", "eagle3", "dflash", "dspark")
TINY = {
    "distillspec": ["model=tiny", "data=stdlib", "method.prompt_len=64", "eval.prompt_len=64"],
    "steering": ["model=tiny", "data=stdlib", "method.prompt_len=64", "eval.prompt_len=64"],
    **{
        m: [
            "model=tiny",
            "data=stdlib",
            "eval.prompt_len=64",
            "method.num_prompts=16",
            "method.num_val_prompts=4",
            "method.answer_tokens=8",
            "method.answer_prompt_len=32",
            "method.max_len=96",
            "method.draft_vocab_size=64",
        ]
        for m in ("medusa", "medusa2")
    },
    "eagle3": [
        "model=tiny",
        "data=stdlib",
        "eval.prompt_len=64",
        "method.answers=null",
        "method.num_prompts=16",
        "method.num_val_prompts=4",
        "method.answer_tokens=8",
        "method.prompt_len=32",
        "method.max_len=96",
        "method.draft_vocab_size=64",
        "method.feature_cache_gb=0.1",
        "trainer.max_steps=8",  # two epochs of 4 batches: the second from the feature cache
    ],
    **{
        m: [
            "model=tiny",
            "data=stdlib",
            "eval.prompt_len=64",
            "method.answers=null",
            "method.sampled_answers=0",
            "method.num_prompts=16",
            "method.num_val_prompts=4",
            "method.answer_tokens=8",
            "method.prompt_len=32",
            "method.max_len=96",
            "method.draft_vocab_size=64",
            "method.block_size=4",
            "method.num_anchors=8",
            "method.feature_cache_gb=0.1",
            "method.feature_cache_dir=null",
            "trainer.max_steps=8",  # two epochs of 4 batches: the second from the feature cache
        ]
        for m in ("dflash", "dspark")
    },
}
"""The experiments run on the real pair by default; the smoke run takes them on the micro tiny pair (Medusa's
and EAGLE-3's answers generated from its corpus). Given after the shared overrides, so they win."""
STAGE_TIMEOUT = 900
"""Seconds one stage may run (a micro stage takes well under a minute on a GPU)."""


class Stage(NamedTuple):
    label: str
    argv: list[str]
    skip: str | None = None
    """Why the stage does not run on this machine (None: it runs)."""


def stages(gpus: int) -> list[Stage]:
    """Every stage, in order. DistillSpec runs first: SD^2 then trains its ``distillspec_steered`` arm on
    that drafter."""
    train = [sys.executable, "train.py"]
    evaluate = [sys.executable, "scripts/evaluate.py", "logger=csv", *MICRO_PAIR, *MICRO_EVAL]
    out = [
        Stage(
            f"{m} bf16 (trainer=gpu)",
            [
                *train,
                f"experiment={m}",
                "trainer=gpu",
                "model.dtype=bfloat16",
                *MICRO_PAIR,
                *MICRO_RUN,
                *TINY.get(m, []),
            ],
        )
        for m in METHODS
    ]
    for m in METHODS:
        # one FSDP1 unit holds Medusa-2's verifier and its float32 adapters: one dtype (docs/scale.md)
        dtype = "float32" if m == "medusa2" else "bfloat16"
        fsdp = ["trainer=fsdp", f"trainer.devices={gpus}", f"model.dtype={dtype}"]
        out.append(
            Stage(
                f"{m} FSDP x{gpus}",
                [*train, f"experiment={m}", *fsdp, *MICRO_PAIR, *MICRO_RUN, *TINY.get(m, [])],
            )
        )
    out.append(Stage("evaluate device=cuda", [*evaluate, "device=cuda"]))
    out.append(
        Stage(
            "evaluate device=cuda:0 drafter_device=cuda:1",
            [*evaluate, "device=cuda:0", "drafter_device=cuda:1"],
            None if gpus >= 2 else "needs two GPUs",
        )
    )
    return out


def evaluations(root: Path) -> set[Path]:
    return set(root.glob("checkpoints/**/results.json"))


def summarize(results: list[Path]) -> tuple[bool, str]:
    """(every evaluation ran on CUDA, the figure to show: devices and the best measured speedup)."""
    devices, speedups = set(), []
    for path in results:
        data = json.loads(path.read_text())
        devices.add(str(data.get("environment", {}).get("device")))
        speedups += [
            r["metrics"]["speedup"]["mean"]
            for r in data.get("runs", [])
            if isinstance(r.get("metrics", {}).get("speedup", {}).get("mean"), (int, float))
        ]
    if not results:
        return False, "no results.json written"
    on_cuda = all(d.startswith("cuda") for d in devices)
    figure = f"evaluated on {', '.join(sorted(devices))}"
    if speedups:
        figure += f", best speedup {max(speedups):.2f}x"
    return on_cuda, figure


def run_stage(label: str, cmd: list[str], root: Path) -> tuple[str, float, str]:
    """Run one stage under ``root`` (its DRAFTSMITH_ROOT): (status, seconds, figure). The full output of
    a failed stage is kept beside the runs (``<root>/<label>.log``)."""
    env = {**os.environ, "DRAFTSMITH_ROOT": str(root), "WANDB_MODE": "offline"}
    before = evaluations(root)
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, timeout=STAGE_TIMEOUT, check=False)
        returncode, output = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as err:
        returncode = -1
        output = (err.stdout or b"") + (err.stderr or b"") + f"\ntimed out after {STAGE_TIMEOUT} s".encode()
    seconds = time.perf_counter() - start
    if returncode != 0:
        log = root / (re.sub(r"[^\w.-]+", "_", label) + ".log")
        text = output.decode(errors="replace")
        log.write_text(text)
        last = (text.strip().splitlines() or ["?"])[-1]
        return f"FAILED ({returncode})", seconds, f"{last[:100]} (log: {log})"
    on_cuda, figure = summarize(sorted(evaluations(root) - before))
    return ("ok" if on_cuda else "FAILED (not on CUDA)"), seconds, figure


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gpu_smoke.py", description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    parser.add_argument("--keep", action="store_true", help="keep the scratch DRAFTSMITH_ROOT")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    plan = stages(max(gpus, 1))
    if args.dry_run:
        for stage in plan:
            print(f"# {stage.label}" + (f" (skipped: {stage.skip})" if stage.skip else ""))
            print(" ".join(stage.argv[1:]))
        return 0
    if gpus == 0:
        print("No CUDA device on this machine: the GPU smoke run needs one (--dry-run lists its commands).")
        return 2
    root = Path(tempfile.mkdtemp(prefix="draftsmith-gpu-smoke-"))
    rows = []
    for label, cmd, skip in plan:
        if skip is not None:
            rows.append((label, "skipped", 0.0, skip))
            continue
        status, seconds, figure = run_stage(label, cmd, root)
        rows.append((label, status, seconds, figure))
        print(f"{label}: {status} in {seconds:.0f} s", flush=True)
    print(f"\nGPU smoke run on {gpus} x {torch.cuda.get_device_name(0)}")
    print("| stage | status | seconds | figure |\n|---|---|---:|---|")
    for label, status, seconds, figure in rows:
        print(f"| {label} | {status} | {seconds:.0f} | {figure} |")
    failed = [r for r in rows if r[1].startswith("FAILED")]
    if args.keep or failed:
        print(f"outputs: {root}")
    else:
        shutil.rmtree(root, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
