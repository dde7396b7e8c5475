"""Devices and generators: the output depends on the torch.Generator passed, not on where models sit.

Every random number of the decoders is drawn from the generator on the generator's own device, so a
CPU generator must work with both models on cuda:0, and with the verifier on cuda:0 and the drafter on
the CPU (two devices), and give the same tokens as the all-CPU run for the same seed (float32, TF32
off; greedy: tokens and counts exactly; sampling: the same tokens). The entry points on CUDA: the
evaluator with ``device=cuda``, and every stage of ``scripts/gpu_smoke.py`` (each method trained in bf16
and under FSDP, its finish step evaluating on the GPU). Run with ``pytest -m gpu``; these tests skip
without CUDA.
"""

from __future__ import annotations

import copy
import subprocess
import sys

import pytest
import torch

from tests.conftest import REPO_ROOT
from tests.test_docs_commands import load_script
from train.decoding import (
    AutoregressiveDecoder,
    Eagle3Decoder,
    SamplingParams,
    SpeculativeDecoder,
)

from .decoding_helpers import build, hf_greedy, overlapped, tiny_config
from .test_eagle3_decoding import PROMPTS, OracleDrafter, drafter_for

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

PLACEMENTS = {
    "both_cuda": ("cuda:0", "cuda:0"),
    "verifier_cuda_drafter_cpu": ("cuda:0", "cpu"),
    "verifier_cpu_drafter_cuda": ("cpu", "cuda:0"),
}
SAMPLING = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.8, top_k=20, top_p=0.9)]


@pytest.fixture(autouse=True)
def _strict_float32():
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


@pytest.fixture(scope="module")
def cpu_pair():
    """A tiny Llama verifier and a drafter that agrees with it often (a perturbed copy), float32."""
    verifier = build(tiny_config("llama", 64), 1)
    drafter = copy.deepcopy(verifier)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in drafter.parameters():
            if p.numel() > 1:
                p.add_(torch.randn(p.shape, generator=g) * 0.1 * p.std())
    return verifier, drafter.eval()


def placed(pair, placement):
    v_dev, d_dev = PLACEMENTS[placement]
    return copy.deepcopy(pair[0]).to(v_dev), copy.deepcopy(pair[1]).to(d_dev)


def prompt_ids(seed: int) -> torch.Tensor:
    return torch.randint(2, 128, (1, 7), generator=torch.Generator().manual_seed(seed))


def counts(stats):
    return (
        stats.accepted,
        stats.drafted,
        stats.tested,
        stats.verifier_calls,
        stats.drafter_calls,
        stats.new_tokens,
    )


@pytest.mark.parametrize("placement", list(PLACEMENTS))
def test_greedy_on_any_devices_equals_cpu(cpu_pair, placement):
    verifier, drafter = placed(cpu_pair, placement)
    for seed in (0, 1):
        ids = prompt_ids(seed)
        ref = SpeculativeDecoder(*cpu_pair, gamma=4).generate(ids, 24)
        res = SpeculativeDecoder(verifier, drafter, gamma=4).generate(ids, 24)
        assert res.tokens.device.type == "cpu"
        assert res.tokens.tolist() == ref.tokens.tolist()
        assert counts(res.stats) == counts(ref.stats)
        assert res.stats.verifier_time > 0 and res.stats.drafter_time > 0


@pytest.mark.parametrize("placement", list(PLACEMENTS))
@pytest.mark.parametrize("params", SAMPLING, ids=["T1", "T0.8_topk_topp"])
def test_sampling_with_a_cpu_generator_equals_cpu(cpu_pair, placement, params):
    """Same CPU generator seed -> the same sampled tokens as the all-CPU run, on every placement."""
    verifier, drafter = placed(cpu_pair, placement)
    for seed in range(4):
        ids = prompt_ids(seed)
        ref = SpeculativeDecoder(*cpu_pair, gamma=3).generate(
            ids, 20, params, generator=torch.Generator().manual_seed(seed)
        )
        res = SpeculativeDecoder(verifier, drafter, gamma=3).generate(
            ids, 20, params, generator=torch.Generator().manual_seed(seed)
        )
        assert res.tokens.tolist() == ref.tokens.tolist(), (placement, seed)
        assert counts(res.stats) == counts(ref.stats)


def test_autoregressive_on_cuda_with_a_cpu_generator(cpu_pair):
    verifier = copy.deepcopy(cpu_pair[0]).to("cuda:0")
    for seed in range(3):
        ids = prompt_ids(seed)
        ref = AutoregressiveDecoder(cpu_pair[0]).generate(
            ids, 20, SAMPLING[0], generator=torch.Generator().manual_seed(seed)
        )
        res = AutoregressiveDecoder(verifier).generate(
            ids, 20, SAMPLING[0], generator=torch.Generator().manual_seed(seed)
        )
        assert res.tokens.tolist() == ref.tokens.tolist()
    greedy = AutoregressiveDecoder(verifier).generate(prompt_ids(0), 20)
    assert (
        greedy.tokens.tolist()
        == AutoregressiveDecoder(cpu_pair[0]).generate(prompt_ids(0), 20).tokens.tolist()
    )


def test_cuda_generator_is_reproducible(cpu_pair):
    """A generator on cuda:0 works too (draws on its own device) and the same seed repeats."""
    verifier, drafter = placed(cpu_pair, "verifier_cuda_drafter_cpu")
    dec = SpeculativeDecoder(verifier, drafter, gamma=3)
    outs = [
        dec.generate(
            prompt_ids(0), 20, SAMPLING[0], generator=torch.Generator("cuda:0").manual_seed(5)
        ).tokens.tolist()
        for _ in range(2)
    ]
    assert outs[0] == outs[1] and len(outs[0]) == 20


@pytest.mark.parametrize("idle", ["step", "wait"])
@pytest.mark.parametrize("placement", [*PLACEMENTS, "two_gpus"])
def test_async_decoder_on_devices_keeps_greedy_output(cpu_pair, placement, idle):
    """AMUSD with the models on GPUs (two GPUs when present, as the method intends): the same greedy
    tokens as autoregressive decoding on the CPU, and no thread left behind. How many drafts a block
    holds depends on timing: with ``idle="step"`` a drafter slower than the verifier (on one H200 the
    tiny drafter's thread, paying its first cuBLAS call, drafted only stale tokens) is never waited for,
    so only ``idle="wait"`` must use drafts."""
    if placement == "two_gpus":
        if torch.cuda.device_count() < 2:
            pytest.skip("needs two GPUs")
        verifier, drafter = copy.deepcopy(cpu_pair[0]).to("cuda:0"), copy.deepcopy(cpu_pair[1]).to("cuda:1")
    else:
        verifier, drafter = placed(cpu_pair, placement)
    ids = torch.tensor([[0, 5, 9, 3, 7]])
    expected = AutoregressiveDecoder(cpu_pair[0]).generate(ids, 40).tokens
    result = overlapped(verifier, drafter, gamma=6, idle=idle).generate(ids, 40)
    assert torch.equal(result.tokens, expected)
    if idle == "wait":
        assert result.stats.accepted > 0 and result.stats.verifier_calls < 40


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_async_benchmark_on_two_gpus():
    """The AMUSD benchmark as the method intends it: verifier on cuda:0, drafter on cuda:1, against
    synchronous SD and autoregressive decoding in one run (greedy outputs checked by the script)."""
    cmd = [
        sys.executable,
        "scripts/bench.py",
        "async",
        "--pairs",
        "bench",
        "--devices",
        "cuda:0",
        "cuda:1",
        "--threads",
        "1",
        "--prompts",
        "4",
        "--tokens",
        "128",
    ]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    print(proc.stdout)
    assert "async gamma" in proc.stdout


# ------------------------------------------------------------------ EAGLE-3 on CUDA


@pytest.fixture(scope="module", params=["oracle", "reduced"])
def eagle3_pair(request):
    """A 4-layer tiny Llama verifier (EAGLE-3 reads three of its layers) and, float32, as
    test_eagle3_decoding's: ``oracle``, a drafter that knows the greedy continuation of PROMPTS[0] (long
    accepted paths); ``reduced``, a random drafter over every third token id (d2t on the device)."""
    verifier = build(tiny_config("llama", 32, layers=4), 1)
    if request.param == "reduced":
        return verifier, drafter_for(verifier, "reduced")
    prompt = PROMPTS[0]
    sequence = prompt + hf_greedy(verifier, torch.tensor([prompt]), 40)
    return verifier, OracleDrafter.from_verifier(verifier).set_reference(sequence).eval()


@pytest.mark.parametrize("placement", list(PLACEMENTS))
def test_eagle3_on_any_devices_equals_cpu(eagle3_pair, placement):
    """The tree at T = 0, the sampled chain and the sampled tree at T = 1 (a CPU generator) give the all-CPU
    run's tokens and counts with the verifier and the drafter wherever they are (the fused features and d2t
    cross devices)."""
    verifier, drafter = placed(eagle3_pair, placement)
    for seed, prompt in enumerate(PROMPTS[:2]):
        ids = torch.tensor([prompt])
        tree_ref = Eagle3Decoder(*eagle3_pair, 4, 3, 10).generate(ids, 24)
        tree = Eagle3Decoder(verifier, drafter, 4, 3, 10).generate(ids, 24)
        assert tree.tokens.tolist() == tree_ref.tokens.tolist() == hf_greedy(eagle3_pair[0], ids, 24)
        assert counts(tree.stats) == counts(tree_ref.stats)
        for sampled in ({"sampled_chain": True}, {"sampled_tree": [3, 1]}):
            runs = [
                Eagle3Decoder(v, d, 4, 3, 10, **sampled).generate(
                    ids, 24, SAMPLING[0], generator=torch.Generator().manual_seed(seed)
                )
                for v, d in (eagle3_pair, (verifier, drafter))
            ]
            assert runs[1].tokens.tolist() == runs[0].tokens.tolist(), (placement, seed, sampled)
            assert counts(runs[1].stats) == counts(runs[0].stats)


# ------------------------------------------------------------------ DFlash on CUDA


@pytest.fixture(scope="module", params=["full", "reduced-markov"])
def dflash_pair(request):
    """A 4-layer tiny Llama verifier and, float32, test_dflash_decoding's perturbed DFlash drafter: ``full``,
    over the whole vocabulary; ``reduced-markov``, over every third id with DSpark's Markov head (d2t and
    the bias table on the device)."""
    from .test_dflash_decoding import drafter_for as dflash_drafter_for

    verifier = build(tiny_config("llama", 32, layers=4), 1)
    if request.param == "full":
        return verifier, dflash_drafter_for(verifier, "full", block_size=4)
    return verifier, dflash_drafter_for(verifier, "reduced", block_size=4, markov_rank=8)


@pytest.mark.parametrize("placement", list(PLACEMENTS))
def test_dflash_on_any_devices_equals_cpu(dflash_pair, placement):
    """The whole block and a tree of the slots' candidates at T = 0, and the sampled chain and tree at
    T = 1 (a CPU generator), give the all-CPU run's tokens and counts with the verifier and the drafter
    wherever they are (the context rows, the block's logits, d2t and the Markov walk cross devices)."""
    from train.decoding import DFlashDecoder

    verifier, drafter = placed(dflash_pair, placement)
    for seed, prompt in enumerate(PROMPTS[:2]):
        ids = torch.tensor([prompt])
        for shape in ({}, {"tree_nodes": 6}):
            greedy = [
                DFlashDecoder(v, d, **shape).generate(ids, 24) for v, d in (dflash_pair, (verifier, drafter))
            ]
            assert (
                greedy[1].tokens.tolist() == greedy[0].tokens.tolist() == hf_greedy(dflash_pair[0], ids, 24)
            )
            assert counts(greedy[1].stats) == counts(greedy[0].stats), (placement, shape)
            runs = [
                DFlashDecoder(v, d, **shape).generate(
                    ids, 24, SAMPLING[0], generator=torch.Generator().manual_seed(seed)
                )
                for v, d in (dflash_pair, (verifier, drafter))
            ]
            assert runs[1].tokens.tolist() == runs[0].tokens.tolist(), (placement, seed, shape)
            assert counts(runs[1].stats) == counts(runs[0].stats)


# ------------------------------------------------------------------ the entry points on CUDA


@pytest.mark.parametrize(("device", "drafter_device"), [("cuda", None), ("cuda:0", "cpu")])
def test_the_evaluator_decodes_on_cuda(tiny_pair_dir, text_file, tmp_path, device, drafter_device):
    """scripts/evaluate.py's main with device=cuda (and the drafter on another device): the models are
    placed there, results.json says so, and the greedy check passes."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from tests.conftest import CONF_DIR
    from train.cli.evaluate_command import main as evaluate_main

    overrides = [
        f"model.verifier={tiny_pair_dir / 'verifier'}",
        f"model.drafter={tiny_pair_dir / 'drafter'}",
        "model.tiny=null",
        "data=local",
        "data.name=jsonl",
        f"data.data_files={text_file}",
        "data.test_fraction=0.5",
        "logger=none",
        "eval.num_prompts=2",
        "eval.prompt_len=12",
        "eval.max_new_tokens=12",
        "eval.seeds=[0]",
        "eval.progress=false",
        "eval.plots=false",
        f"device={device}",
        f"drafter_device={drafter_device if drafter_device else 'null'}",
        f"paths.root_dir={tmp_path}",
    ]
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="eval", overrides=overrides, return_hydra_config=True)
    cfg.paths.run_dir = str(tmp_path / "run")
    results = evaluate_main(cfg)
    assert results["environment"]["device"] == "cuda:0"
    assert all(r["greedy_match"] for r in results["runs"] if r["temperature"] == 0.0)


SMOKE = load_script("scripts/gpu_smoke.py")


@pytest.fixture(scope="module")
def smoke_root(tmp_path_factory):
    """One scratch DRAFTSMITH_ROOT for the smoke stages: the first builds the micro pair, SD^2 finds the
    DistillSpec run before it, as in scripts/gpu_smoke.py."""
    return tmp_path_factory.mktemp("gpu_smoke")


@pytest.mark.parametrize(
    "stage", SMOKE.stages(max(torch.cuda.device_count(), 1)), ids=lambda stage: stage.label
)
def test_gpu_smoke_stage(stage, smoke_root):
    """Each stage of scripts/gpu_smoke.py (every method in bf16 on one GPU, under FSDP on the GPUs present,
    the evaluator on CUDA): it exits 0 and every evaluation it wrote ran on CUDA, the finish step's
    included."""
    if stage.skip:
        pytest.skip(stage.skip)
    status, seconds, figure = SMOKE.run_stage(stage.label, stage.argv, smoke_root)
    print(f"{stage.label}: {status} in {seconds:.0f} s ({figure})")
    assert status == "ok", figure
