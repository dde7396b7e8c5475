"""What a research script decodes with (``scripts/trees.py``, ``bpd.py``, ``medusa_eval.py``): the verifier,
the drafter, their dtype, the prompts and the evaluator's tie tolerance, resolved as the pair's recipe or
the training run set them, so a script measures what the run's own evaluation measures.

- :func:`pair_setup`: a cached pair folder (``verifier/`` + ``drafter/``). The real pair (a folder the
  SmolLM2 build wrote, with its ``pair.json``) runs as the real-pair experiments evaluate it: the
  machine's best dtype (``${best_dtype:}``), held-out chat prompts (``conf/data/chat.yaml``) of at most
  256 tokens, near-ties within 16 ulps in bfloat16. Any other pair (the tiny one) runs in float32 on
  64-token windows of the embedded corpus.
- :func:`heads_setup`: the training run that saved a ``heads/`` folder (its ``config.yaml``:
  ``model.verifier``, ``model.drafter``, ``model.dtype``, ``data``, ``eval.prompt_len``,
  ``eval.tie_ulps``, ``method.answers``; Medusa-2's merged ``verifier/`` beside the heads); heads without
  a run config fall back to the tiny pair and the embedded corpus.
"""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass
from typing import Any

import torch
from omegaconf import OmegaConf

from train.config import instantiate_group
from train.evaluation import build_prompts
from train.hardware import best_dtype
from train.pairs.smollm2_pair import MANIFEST
from train.paths import PROJECT_ROOT, project_root, register_resolvers
from train.training.answer_sources import pair_answers_folder

__all__ = ["DecodeSetup", "conf_data", "heads_setup", "newest_heads", "pair_setup"]

#: The real-pair experiments' ``eval.prompt_len`` (conf/experiment/{distillspec,medusa,eagle3}.yaml).
REAL_PAIR_PROMPT_LEN = 256
#: The real-pair experiments' and the leaderboard's ``eval.tie_ulps`` in bfloat16; 4 is the default.
BF16_TIE_ULPS, TIE_ULPS = 16.0, 4.0
#: The tiny pair's prompts: 64-token windows of the embedded corpus (conf/eval/default.yaml).
TINY_PROMPT_LEN = 64


@dataclass(frozen=True)
class DecodeSetup:
    """Model folders, dtype, prompt source and tie tolerance of one measurement."""

    verifier: str
    drafter: str | None
    dtype: str
    data: Any
    """A :class:`train.data.sources.DataSourceConfig`: where the prompts come from."""
    prompt_len: int
    tie_ulps: float
    answers: str | None = None
    """A folder of the verifier's cached answers (one ``.pt`` file per split), when there is one."""
    real_pair: bool = False

    def prompts(
        self, tokenizer: Any, num_prompts: int, seed: int = 0, split: str = "test"
    ) -> list[torch.Tensor]:
        """The evaluator's prompts (:func:`train.evaluation.build_prompts`) for this setup."""
        return build_prompts(tokenizer, self.data, num_prompts, self.prompt_len, seed=seed, split=split)


def conf_data(name: str, seed: int = 0) -> Any:
    """``conf/data/<name>.yaml`` as a run composes it: ``${seed}`` is ``seed``, ``${paths.data_dir}`` the
    project's ``data/`` (under ``$DRAFTSMITH_ROOT`` when set)."""
    node = OmegaConf.load(PROJECT_ROOT / "conf" / "data" / f"{name}.yaml")
    paths = {"data_dir": os.path.join(project_root(), "data")}
    return instantiate_group(OmegaConf.create({"seed": seed, "paths": paths, "data": node}), "data")


def _tiny_setup(verifier: str, drafter: str | None) -> DecodeSetup:
    return DecodeSetup(verifier, drafter, "float32", conf_data("stdlib"), TINY_PROMPT_LEN, TIE_ULPS)


def pair_setup(pair_dir: str) -> DecodeSetup:
    """The setup of the pair cached in ``pair_dir`` (see the module docstring)."""
    verifier, drafter = os.path.join(pair_dir, "verifier"), os.path.join(pair_dir, "drafter")
    if not os.path.isfile(os.path.join(pair_dir, MANIFEST)):
        return _tiny_setup(verifier, drafter)
    dtype = best_dtype()
    return DecodeSetup(
        verifier,
        drafter,
        dtype,
        conf_data("chat"),
        REAL_PAIR_PROMPT_LEN,
        BF16_TIE_ULPS if dtype == "bfloat16" else TIE_ULPS,
        answers=os.path.join(pair_dir, "answers"),
        real_pair=True,
    )


def _answers_folder(run: Any) -> str | None:
    """Where the run's training answers are cached (``method.answers``: a folder, or ``pair``: the pair's
    cache); None when the run trained on the corpus or generated its answers."""
    source = OmegaConf.select(run, "method.answers")
    if source is None:
        return None
    return pair_answers_folder(run.model) if source == "pair" else str(source)


def heads_setup(heads_dir: str, verifier: str | None = None) -> DecodeSetup:
    """The setup of the run that saved ``heads_dir``; ``verifier`` (a folder) overrides the run's."""
    run_dir = os.path.dirname(os.path.abspath(heads_dir))
    config = os.path.join(run_dir, "config.yaml")
    if not os.path.isfile(config):
        tiny = os.path.join(project_root(), "checkpoints", "tiny")
        return _tiny_setup(verifier or os.path.join(tiny, "verifier"), os.path.join(tiny, "drafter"))
    register_resolvers()  # a config saved unresolved may still read ${best_dtype:}
    run = OmegaConf.load(config)
    merged = os.path.join(run_dir, "verifier")  # Medusa-2: the fine-tuned verifier the heads belong to
    drafter = OmegaConf.select(run, "model.drafter")
    dtype = str(run.model.dtype)
    return DecodeSetup(
        verifier or (merged if os.path.isdir(merged) else str(run.model.verifier)),
        None if drafter is None else str(drafter),
        dtype,
        instantiate_group(run, "data"),
        int(run.eval.prompt_len),
        float(run.eval.tie_ulps),
        answers=_answers_folder(run),
        real_pair=OmegaConf.select(run, "model.smollm2") is not None,
    )


def newest_heads(experiments: str = "medusa*") -> str | None:
    """The most recently written ``checkpoints/<experiments>/<run>/heads`` (a glob), or None."""
    found = glob.glob(os.path.join(project_root(), "checkpoints", experiments, "*", "heads"))
    return max(found, key=os.path.getmtime, default=None)
