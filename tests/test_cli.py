"""Errors a user can fix: one line naming the key or the file, an exit status, the traceback only
when asked (train/cli/console.py, and the checks in config, loading and data sources it reports)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import train.cli.console as cli
from tests.conftest import CONF_DIR, REPO_ROOT
from train.config import ConfigError, instantiate_group
from train.data.sources import DataError, DataSourceConfig, load_text_dataset
from train.models import loading
from train.models.loading import CorruptModelError, ModelNotFoundError, load_model


def test_expected_error_is_one_line_and_an_exit_status(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    for var in cli.DEBUG_VARIABLES:
        monkeypatch.delenv(var, raising=False)

    def bad_value() -> None:
        raise ConfigError("trainer.max_steps must be >= 1, got 0")

    with pytest.raises(SystemExit) as exit_info:
        cli.report_errors(bad_value)
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == "error: trainer.max_steps must be >= 1, got 0\n"

    def missing() -> None:
        raise FileNotFoundError("ckpt_path=last: no checkpoints/last.ckpt under x")

    with pytest.raises(SystemExit) as exit_info:
        cli.report_errors(missing)
    assert exit_info.value.code == 1

    def bug() -> None:
        raise KeyError("a bug keeps its traceback")

    with pytest.raises(KeyError):
        cli.report_errors(bug)


def test_debug_variable_shows_the_traceback(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HYDRA_FULL_ERROR", "1")

    def bad_value() -> None:
        raise ConfigError("x must be y")

    with pytest.raises(ConfigError):
        cli.report_errors(bad_value)


def test_override_typo_names_the_valid_keys(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.check_overrides(str(CONF_DIR), "train", ["experiment=distillspec", "method.divergance=fkl"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "method.divergance is not a setting of method; did you mean method.divergence?" in err
    assert "Valid keys: " in err and "data_source" in err and "_target_" not in err
    # Good overrides, sweeps and Hydra flags pass untouched (Hydra reports what it rejects itself).
    cli.check_overrides(str(CONF_DIR), "train", ["experiment=distillspec", "method.divergence=rkl"])
    cli.check_overrides(str(CONF_DIR), "train", ["-m", "method.divergance=fkl,rkl"])


def test_appended_unknown_key_names_the_dataclass_fields() -> None:
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("train", overrides=["experiment=distillspec", "+method.divergance=fkl"])
    with pytest.raises(
        ConfigError,
        match=(
            r"method.divergance is not a setting of method; did you mean method.divergence\? "
            r"Valid keys: .*lmbda"
        ),
    ):
        instantiate_group(cfg, "method")


def test_corrupt_safetensors_names_the_file(tiny_pair_dir: Path, tmp_path: Path) -> None:
    folder = tmp_path / "drafter"
    shutil.copytree(tiny_pair_dir / "drafter", folder)
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])  # an interrupted copy
    with pytest.raises(CorruptModelError, match=rf"{weights} is truncated or corrupt.*re-copy or re-export"):
        load_model(str(folder), role="model.drafter")
    weights.write_bytes(b"\x00" * 100)
    with pytest.raises(CorruptModelError, match=str(weights)):
        load_model(str(folder), role="model.drafter")


def test_missing_drafter_is_named_as_the_model_not_the_tokenizer(tmp_path: Path) -> None:
    # The pair's drafter folder is read for its tokenizer first: the error still names the model.
    with pytest.raises(ModelNotFoundError, match=r"^model.drafter: no model folder at '.*nowhere'$"):
        loading.drafter_tokenizer_source(str(tmp_path / "nowhere"))


def test_empty_data_file_is_named(tmp_path: Path) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(DataError, match=rf"data.data_files: {empty} is empty"):
        load_text_dataset(DataSourceConfig(name="jsonl", data_files=str(empty)))


def test_unreachable_hub_fails_at_once_naming_the_key(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[float] = []

    def no_network(repo_id: str, timeout: float) -> None:
        calls.append(timeout)
        raise ConnectionError("[Errno -2] Name or service not known")

    monkeypatch.setattr(loading.hf_constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(loading.huggingface_hub, "model_info", no_network)
    monkeypatch.setattr(loading.huggingface_hub, "try_to_load_from_cache", lambda *a, **k: None)
    loading.check_hub_reachable.cache_clear()
    with pytest.raises(
        ModelNotFoundError, match=r"^model.verifier: cannot reach the Hugging Face Hub for 'org/big'"
    ):
        loading.load_tokenizer("org/big", role="model.verifier")
    assert calls == [10]  # one short probe, no retry loop
    loading.check_hub_reachable.cache_clear()


def test_train_py_prints_one_line_and_exits_2_on_a_bad_value(tmp_path: Path) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "train.py",
            "experiment=distillspec",
            "trainer.max_steps=0",
            f"hydra.run.dir={tmp_path / 'run'}",
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1] == "error: trainer.max_steps must be >= 1, got 0"
    assert "Traceback" not in proc.stderr + proc.stdout
    assert not (tmp_path / "run").exists()


def test_library_warnings_go_to_the_log_file_not_the_terminal(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import logging
    import warnings

    from train.cli.console import warnings_to_log_file

    root = logging.getLogger()
    log_file = logging.FileHandler(tmp_path / "train.log")
    console = logging.StreamHandler(sys.stderr)
    root.addHandler(log_file)
    root.addHandler(console)
    try:
        warnings_to_log_file()
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.warn("past_key_values is deprecated", FutureWarning, stacklevel=1)
    finally:
        root.removeHandler(log_file)
        root.removeHandler(console)
        logging.captureWarnings(False)
        logging.getLogger("py.warnings").handlers.clear()
        log_file.close()
    captured = capsys.readouterr()
    assert "past_key_values" not in captured.err + captured.out
    assert "FutureWarning: past_key_values is deprecated" in (tmp_path / "train.log").read_text()


def test_only_rank_zero_writes_the_job_log(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every rank starts the same Hydra job with a file handler on the same train.log: the console setup
    closes it on every rank but 0."""
    import logging

    root = logging.getLogger()
    for rank, expected in (("0", "from rank 0\n"), ("1", "")):
        path = tmp_path / f"train_{rank}.log"
        handler = logging.FileHandler(path)
        root.addHandler(handler)
        monkeypatch.setenv("LOCAL_RANK", rank)
        try:
            cli.quiet_console()
            logging.getLogger("draftsmith.test").warning("from rank %s", rank)
        finally:
            root.removeHandler(handler)
            handler.close()
        assert path.read_text() == expected
