"""The one pair set-up of the benchmarks and research scripts (``scripts/bench.py``, ``trees.py``, ``bpd.py``,
``medusa_eval.py``, ``lenience.py``): the verifier, the drafter, their dtype, the prompts and the evaluator's
tie tolerance, resolved as the pair's recipe or the training run set them, so a script measures what the
run's own evaluation measures.

- :func:`pair_setup`: a cached pair folder (``verifier/`` + ``drafter/``). The real pair (a folder the
  SmolLM2 build wrote, with its ``pair.json``) runs as the real-pair experiments evaluate it: the
  machine's best dtype (``${best_dtype:}``), held-out chat prompts (``conf/data/chat.yaml``) of at most
  256 tokens, near-ties within 16 ulps in bfloat16. Any other pair (the tiny one) runs in float32 on
  64-token windows of the embedded corpus.
- :func:`heads_setup`: the training run that saved a ``heads/`` folder (its ``config.yaml``:
  ``model.verifier``, ``model.drafter``, ``model.dtype``, ``data``, ``eval.prompt_len``,
  ``eval.tie_ulps``, ``method.answers``; Medusa-2's merged ``verifier/`` beside the heads); heads without
  a run config fall back to the tiny pair and the embedded corpus.
- :func:`load_pair`: the models of a set-up, in its dtype, on the devices asked for; :func:`real_pair`:
  a cached pair's models and its held-out prompts.
- :func:`random_pair`, :func:`random_prompts`: the random-weight benchmark pair (no checkpoint needed).
- :func:`newest_heads`, :func:`newest_eagle3`: the newest finished run's artifact
  (:func:`train.rundir.newest_artifact`, the one rule).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
from omegaconf import OmegaConf
from transformers import AutoModelForCausalLM, LlamaConfig

from train.config import instantiate_group
from train.evaluation import EvalConfig, build_prompts
from train.hardware import best_dtype
from train.models.draft_vocab import with_draft_vocab
from train.models.loading import load_model, load_tokenizer
from train.pairs.smollm2_pair import MANIFEST
from train.paths import PROJECT_ROOT, project_root, register_resolvers
from train.rundir import newest_artifact
from train.training.answer_sources import pair_answers_folder

__all__ = [
    "DecodeSetup",
    "LoadedPair",
    "checkpoints",
    "conf_data",
    "heads_setup",
    "load_pair",
    "newest_eagle3",
    "newest_heads",
    "pair_setup",
    "random_pair",
    "random_prompts",
    "real_pair",
]

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

    def eval_config(
        self,
        decoders: list[dict[str, Any]],
        temperatures: list[float],
        seeds: list[int],
        max_new_tokens: int,
        threads: int | None,
    ) -> EvalConfig:
        """The evaluator's settings for a research measurement on this setup: its tie tolerance, no
        progress bar or plots, ``threads`` torch threads while decoding (None: leave them)."""
        return EvalConfig(
            temperatures=temperatures,
            seeds=seeds,
            decoders=decoders,
            max_new_tokens=max_new_tokens,
            progress=False,
            plots=False,
            num_threads=threads,
            tie_ulps=self.tie_ulps,
        )


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
        return _tiny_setup(verifier or checkpoints("tiny", "verifier"), checkpoints("tiny", "drafter"))
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


def checkpoints(*parts: str) -> str:
    """A path under the project's ``checkpoints/`` (``$DRAFTSMITH_ROOT/checkpoints`` when set):
    ``checkpoints("tiny")`` is the embedded pair's folder, ``checkpoints("smollm2")`` the real pair's."""
    return os.path.join(project_root(), "checkpoints", *parts)


def newest_heads(experiments: str = "medusa*") -> str | None:
    """The ``heads/`` of the newest finished run of ``experiments`` (a glob), or None."""
    return newest_artifact(checkpoints(), experiments, None, "heads")


def newest_eagle3(experiments: str = "eagle3") -> str | None:
    """The ``eagle3/`` drafter of the newest finished run of ``experiments`` (a glob), or None."""
    return newest_artifact(checkpoints(), experiments, None, "eagle3")


@dataclass(frozen=True)
class LoadedPair:
    """A set-up's models, ready to decode: the drafter over its draft vocabulary when it has one."""

    verifier: Any
    drafter: Any
    """None when loaded with ``with_drafter=False`` or the set-up has none."""
    tokenizer: Any
    dtype: torch.dtype


def load_pair(
    setup: DecodeSetup,
    *,
    drafter: str | None = None,
    with_drafter: bool = True,
    device: str | torch.device = "cpu",
    drafter_device: str | torch.device | None = None,
) -> LoadedPair:
    """The verifier and drafter of ``setup`` in its dtype, in eval mode, on ``device`` (the drafter on
    ``drafter_device`` when given); ``drafter`` (a folder) replaces the set-up's; ``with_drafter=False``
    loads the verifier alone."""
    dtype = getattr(torch, setup.dtype)
    verifier = load_model(setup.verifier, dtype=setup.dtype, role="verifier", device=device).eval()
    folder = drafter or setup.drafter
    draft_model = None
    if with_drafter and folder is not None:
        loaded = load_model(folder, dtype=setup.dtype, role="drafter", device=drafter_device or device).eval()
        draft_model = with_draft_vocab(loaded)
    return LoadedPair(verifier, draft_model, load_tokenizer(setup.verifier), dtype)


def real_pair(
    folder: str, num_prompts: int, *, drafter: str | None = None, split: str = "validation"
) -> tuple[LoadedPair, list[torch.Tensor]]:
    """The pair cached in ``folder`` (:func:`pair_setup`, :func:`load_pair`) and the first ``num_prompts`` of
    its prompts from ``split`` (held-out chat prompts for the real pair)."""
    setup = pair_setup(folder)
    pair = load_pair(setup, drafter=drafter)
    return pair, setup.prompts(pair.tokenizer, num_prompts, split=split)


def random_prompts(
    num_prompts: int, length: int = 48, vocab: int = 8192, seed: int = 0
) -> list[torch.Tensor]:
    """``num_prompts`` prompts of ``length`` uniform random ids, each (1, length): the benchmark pair's."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (1, length), generator=gen) for _ in range(num_prompts)]


def random_pair(vocab: int = 8192, noise: float = 0.15, seed: int = 0) -> tuple[Any, Any]:
    """The random-weight benchmark pair: a Llama verifier (hidden 512, 8 layers, ~30M parameters) and
    drafter (hidden 128, 2 layers) sharing a bigram structure, so drafts are accepted at a rate that
    ``noise`` (the verifier's unembedding noise) sets."""
    common: dict[str, Any] = {
        "vocab_size": vocab,
        "max_position_embeddings": 1024,
        "bos_token_id": None,
        "eos_token_id": None,
    }
    shapes = {"verifier": (512, 1376, 8, 8), "drafter": (128, 512, 2, 4)}
    models = {}
    torch.manual_seed(seed)
    for role, (hidden, intermediate, layers, heads) in shapes.items():
        config = LlamaConfig(
            hidden_size=hidden,
            intermediate_size=intermediate,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=heads,
            **common,
        )
        models[role] = AutoModelForCausalLM.from_config(config).eval()
    verifier, drafter = models["verifier"], models["drafter"]
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        emb = 4.0 * torch.randn(vocab, 128, generator=g)  # large: the layers only perturb the bigram
        head = torch.randn(vocab, 128, generator=g)
        proj = torch.linalg.qr(torch.randn(512, 128, generator=g)).Q.T  # (128, 512), orthonormal rows
        drafter.get_input_embeddings().weight.copy_(emb)
        drafter.get_output_embeddings().weight.copy_(head)
        verifier.get_input_embeddings().weight.copy_(emb @ proj)
        vhead = head @ proj + noise * torch.randn(vocab, 512, generator=g) / 512**0.5 * 128**0.5
        verifier.get_output_embeddings().weight.copy_(vhead)
    for m in (verifier, drafter):
        m.generation_config.eos_token_id = None
        m.generation_config.pad_token_id = 0
        m.generation_config.bos_token_id = None
    return verifier, drafter
