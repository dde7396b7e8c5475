"""scripts/sweep_table.py: a multirun directory -> the divergence x data source table."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from omegaconf import OmegaConf

from tests.conftest import REPO_ROOT


def _script():
    spec = importlib.util.spec_from_file_location("sweep_table", REPO_ROOT / "scripts" / "sweep_table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def _run(root: Path, i: int, div: str, source: str, before: float, after: float | None, ea: float) -> None:
    run = root / f"{i}_method.data_source={source},method.divergence={div}"
    (run / "csv").mkdir(parents=True)
    OmegaConf.save(
        OmegaConf.create(
            {"name": "distillspec", "method": {"divergence": div, "data_source": source, "lmbda": 0.5}}
        ),
        run / "config.yaml",
    )
    (run / "csv" / "metrics.csv").write_text(
        f"step,train/loss,val/expected_acceptance\n0,1.0,\n49,,{ea - 0.1}\n99,,{ea}\n"
    )
    if after is not None:

        def contract(be: float, gamma: int) -> dict:
            return {
                t: {"block_efficiency": {"mean": be * gamma / 4, "std": 0.0, "n": 2}, "gamma": gamma}
                for t in ("0", "1")
            }

        best = {t: {"decoder": "sd@g4", "gamma": 4} for t in ("0", "1")}
        report = {
            "reference": "before",
            "decoders": ["sd@g2", "sd@g4"],
            "drafters": {
                "before": {f"sd@g{g}": contract(before, g) for g in (2, 4)},
                "after": {f"sd@g{g}": contract(after, g) for g in (2, 4)},
            },
            "best": {"after": best},
        }
        (run / "report.json").write_text(json.dumps(report))


def test_table_from_a_multirun_dir(tmp_path, capsys):
    multirun = tmp_path / "multirun"
    _run(multirun, 0, "fkl", "verifier", 2.0, 2.4, 0.6)
    _run(multirun, 1, "rkl", "teacher", 2.0, 2.2, 0.55)  # a run written before issue 53: read as verifier
    _run(multirun, 2, "fkl", "drafter", 2.0, 2.6, 0.65)
    _run(multirun, 3, "rkl", "drafter", 2.0, None, 0.5)  # did not finish
    (multirun / "multirun.yaml").write_text("hydra: {}\n")
    assert _script().main([str(multirun)]) == 0
    text = (multirun / "sweep_table.md").read_text()
    assert "| fkl |" in capsys.readouterr().out
    payload = json.loads((multirun / "sweep_table.json").read_text())
    ratio = payload["tables"]["block_efficiency_ratio_T0"]
    assert ratio["rows"] == ["fkl", "rkl"] and ratio["columns"] == ["verifier", "drafter"]
    assert ratio["values"][0] == [1.2, 1.3]
    assert ratio["values"][1][0] == 1.1 and ratio["values"][1][1] is None
    assert payload["tables"]["val_expected_acceptance"]["values"][1] == [0.55, 0.5]
    assert "| fkl | 2.400 | 2.600 |" in text  # at each run's best-speedup decoder (gamma 4)
    assert "| rkl | 2.200 | n/a |" in text
    assert len(payload["runs"]) == 4
    assert _script().main([str(multirun), "--decoder", "sd@g2", "--out", str(tmp_path / "g2")]) == 0
    assert "| fkl | 1.200 | 1.300 |" in (tmp_path / "g2" / "sweep_table.md").read_text()


def test_empty_dir_is_an_error(tmp_path, capsys):
    import pytest

    with pytest.raises(SystemExit):
        _script().main([str(tmp_path)])
    assert "no run directories" in capsys.readouterr().err


def test_a_folder_that_is_not_a_sweep_is_refused_and_left_untouched(tmp_path, capsys):
    """A pretraining run's folder has run directories but no DistillSpec runs: exit 2, write nothing."""
    import pytest

    run = tmp_path / "2026-01-01_00-00-00"
    run.mkdir()
    (run / "config.yaml").write_text("name: tiny_pair\nmethod:\n  optimizer: {}\n")
    before = sorted(p.name for p in tmp_path.rglob("*"))
    with pytest.raises(SystemExit) as exit_info:
        _script().main([str(tmp_path)])
    assert exit_info.value.code == 2
    assert "is not a DistillSpec sweep" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.rglob("*")) == before
