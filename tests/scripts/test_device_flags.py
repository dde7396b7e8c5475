"""Every research script that decodes takes ``--device`` (default auto: CUDA when available, else the CPU)
and, with a drafter model, ``--drafter-device`` (default: the verifier's); a device the machine lacks is
argparse's one line naming the flag (exit 2), and the resolved devices reach the models."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

import research.benchmarks.decoders as bench_decoding
import research.benchmarks.overhead as bench_overhead
import research.pairs as pairs
from tests.test_docs_commands import load_script

#: script: (arguments it needs to reach its models, whether it has a drafter model)
SCRIPTS: dict[str, tuple[list[str], bool]] = {
    "scripts/trees.py": ([], True),
    "scripts/bpd.py": (["--heads", "HEADS"], True),
    "scripts/medusa_eval.py": (["--heads", "HEADS", "--verifier", "VERIFIER"], False),
    "scripts/lenience.py": ([], True),
    "bench.py steering-overhead": ([], True),
    "bench.py decoding": ([], False),
    "bench.py overhead": (["--baseline", "OLD"], True),
}


class _Stop(Exception):
    """Raised once the models are placed: nothing after that is under test."""


def _parser_and_args(script: str, extra: list[str]) -> tuple[Any, list[str]]:
    if script.startswith("bench.py"):
        return load_script("scripts/bench.py").build_parser(), [script.split()[1], *extra]
    return load_script(script).build_parser(), extra


@pytest.mark.parametrize("script", list(SCRIPTS))
def test_device_is_cuda_when_available_else_the_cpu(script: str, monkeypatch: pytest.MonkeyPatch) -> None:
    parser, argv = _parser_and_args(script, SCRIPTS[script][0])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    args = parser.parse_args(argv)
    assert args.device == torch.device("cuda")
    assert getattr(args, "drafter_device", None) is None  # the verifier's
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert parser.parse_args(argv).device == torch.device("cpu")
    assert parser.parse_args([*argv, "--device", "cpu"]).device == torch.device("cpu")


@pytest.mark.parametrize("script", [*SCRIPTS, "bench.py async"])
def test_cuda_without_cuda_is_one_line_naming_the_flag(
    script: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    flag = "--devices" if script == "bench.py async" else "--device"
    parser, argv = _parser_and_args(script, SCRIPTS.get(script, ([], False))[0])
    with pytest.raises(SystemExit) as exit_info:
        parser.parse_args([*argv, flag, "cuda"])
    assert exit_info.value.code == 2
    assert f"argument {flag}: {flag}=cuda: CUDA is not available on this machine" in capsys.readouterr().err


def _stub(log: list[torch.device], stop_at: int) -> Any:
    """A model stand-in: ``.eval()`` returns it, ``.to(device)`` records the device (stopping the script
    after ``stop_at`` placements)."""

    def to(device: Any) -> Any:
        log.append(torch.device(device))
        if len(log) >= stop_at:
            raise _Stop
        return model

    model = SimpleNamespace(eval=lambda: model, to=to)
    return model


@pytest.mark.parametrize("script", list(SCRIPTS))
@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (["--device", "meta"], ["meta", "meta"]),  # the drafter follows the verifier
        (["--device", "meta", "--drafter-device", "cpu"], ["meta", "cpu"]),
    ],
)
def test_the_resolved_devices_reach_the_models(
    script: str, flags: list[str], expected: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    extra, has_drafter = SCRIPTS[script]
    if not has_drafter:
        if "--drafter-device" in flags:
            pytest.skip("no drafter model")
        expected = expected[:1]
    log: list[torch.device] = []

    def load_model(source: str, *args: Any, device: Any = None, **kwargs: Any) -> Any:
        return _stub(log, len(expected)).to(device)

    monkeypatch.setattr(pairs, "load_model", load_model)  # the pair set-up's loads (research.pairs)
    monkeypatch.setattr(pairs, "load_tokenizer", lambda *a, **k: None)
    monkeypatch.setattr(pairs, "with_draft_vocab", lambda model: model)
    if script.startswith("bench.py"):
        expected = expected if has_drafter else expected * 2  # bench decoding: both models on --device
        pair = (_stub(log, len(expected)), _stub(log, len(expected)))
        monkeypatch.setattr(bench_decoding, "random_pair", lambda *a, **k: pair)
        monkeypatch.setattr(bench_overhead, "random_pair", lambda *a, **k: pair)
        monkeypatch.setattr(bench_overhead, "load_package", lambda path: None)
        module = load_script("scripts/bench.py")
        argv = [script.split()[1], *extra, *flags]
    else:
        module = load_script(script)
        argv = [*extra, *flags]
        monkeypatch.setattr(module, "load_model", load_model, raising=False)
        monkeypatch.setattr(module, "load_tokenizer", lambda *a, **k: None, raising=False)
        monkeypatch.setattr(module, "resolve_drafter", lambda *a: "DRAFTER", raising=False)
    with pytest.raises(_Stop):
        module.main(argv)
    assert [d.type for d in log] == expected


def test_async_bench_places_the_verifier_and_the_drafter(monkeypatch: pytest.MonkeyPatch) -> None:
    import research.benchmarks.async_decoding as module

    bench = load_script("scripts/bench.py")
    log: list[torch.device] = []
    monkeypatch.setattr(module, "_pairs", lambda *a: {"pair": (_stub(log, 2), _stub(log, 2), [], None)})
    with pytest.raises(_Stop):
        bench.main(["async", "--devices", "meta", "cpu"])
    assert [d.type for d in log] == ["meta", "cpu"]
    log.clear()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(_Stop):
        bench.main(["async"])  # default auto: CUDA when available, for both
    assert [d.type for d in log] == ["cuda", "cuda"]
