"""GPU smoke run: every method for a few steps on one GPU in bf16, FSDP on the GPUs present, and the
evaluator on CUDA, on a micro pair (built in seconds), then one table of what ran.

    python scripts/gpu_smoke.py             # on a machine with CUDA; exits 1 if any stage failed
    python scripts/gpu_smoke.py --dry-run   # print the commands it would run (any machine)

Each stage is the same command a user would type (``python train.py ... trainer=gpu``), run in its own
process under a scratch ``DRAFTSMITH_ROOT``, so nothing lands in the checkout. The gpu-marked tests
(``python -m pytest -m gpu``) cover the same paths at the unit level.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

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
MICRO_RUN = [
    "trainer.max_steps=4",
    "trainer.val_check_interval=4",
    "trainer.limit_val_batches=1",
    "method.batch_size=4",
    "logger=csv",
    "eval.num_prompts=2",
    "eval.max_new_tokens=16",
    "eval.seeds=[0]",
    "eval.plots=false",
    "eval.progress=false",
]
METHODS = ("distillspec", "medusa", "medusa2", "steering")


def stages(gpus: int) -> list[tuple[str, list[str]]]:
    """(label, argv) of every stage; FSDP runs on every GPU present (one is enough to exercise its
    precision plugin and clipping)."""
    train = [sys.executable, "train.py"]
    out = [
        (f"{m} bf16 (trainer=gpu)", [*train, f"experiment={m}", "trainer=gpu", *MICRO_PAIR, *MICRO_RUN])
        for m in METHODS
    ]
    # Medusa-2 keeps a bf16 verifier beside float32 adapters: one FSDP1 unit refuses mixed dtypes
    # (docs/scale.md), so it is left out of the FSDP stages.
    out += [
        (
            f"{m} FSDP x{gpus}",
            [*train, f"experiment={m}", "trainer=fsdp", f"trainer.devices={gpus}", *MICRO_PAIR, *MICRO_RUN],
        )
        for m in ("distillspec", "medusa", "steering")
    ]
    out.append(
        (
            "evaluate device=cuda",
            [sys.executable, "scripts/evaluate.py", "device=cuda", "logger=csv", *MICRO_PAIR, *MICRO_RUN[5:]],
        )
    )
    return out


def key_figure(root: Path, label: str) -> str:
    """The best measured speedup of the newest report or evaluation under ``root`` (or '-')."""
    reports = sorted(root.glob("checkpoints/**/report.json"), key=os.path.getmtime)
    if label.startswith("evaluate"):
        reports = sorted(root.glob("checkpoints/eval/**/results.json"), key=os.path.getmtime)
    if not reports:
        return "-"
    data = json.loads(reports[-1].read_text())
    speedups = [
        t.get("speedup")
        for by_t in data.get("best", {}).values()
        for t in by_t.values()
        if isinstance(t, dict)
    ]
    best = max((s for s in speedups if isinstance(s, (int, float))), default=None)
    return f"best speedup {best:.2f}x" if best is not None else reports[-1].parent.name


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
        for label, cmd in plan:
            print(f"# {label}\n{' '.join(cmd[1:])}")
        return 0
    if gpus == 0:
        print("No CUDA device on this machine: the GPU smoke run needs one (--dry-run lists its commands).")
        return 2
    root = Path(tempfile.mkdtemp(prefix="draftsmith-gpu-smoke-"))
    env = {**os.environ, "DRAFTSMITH_ROOT": str(root), "WANDB_MODE": "offline"}
    rows = []
    for label, cmd in plan:
        start = time.perf_counter()
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
        seconds = time.perf_counter() - start
        ok = proc.returncode == 0
        figure = key_figure(root, label) if ok else (proc.stderr.strip().splitlines() or ["?"])[-1][:80]
        rows.append((label, "ok" if ok else f"FAILED ({proc.returncode})", seconds, figure))
        print(f"{label}: {rows[-1][1]} in {seconds:.0f} s", flush=True)
    print(f"\nGPU smoke run on {gpus} x {torch.cuda.get_device_name(0)}")
    print("| stage | status | seconds | figure |\n|---|---|---|---|")
    for label, status, seconds, figure in rows:
        print(f"| {label} | {status} | {seconds:.0f} | {figure} |")
    if args.keep:
        print(f"outputs: {root}")
    else:
        shutil.rmtree(root, ignore_errors=True)
    return 0 if all(r[1] == "ok" for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
