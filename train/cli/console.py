"""What the command-line entry points (``train.py``, ``scripts/*.py``) share: errors a user can fix
print as one line, and an override naming a key the config does not have lists the keys it does.

An expected error (a bad value, a missing or corrupt file, a mismatched pair, a held run directory,
a non-finite loss) prints ``error: <message>`` on stderr and exits 2 (configuration) or 1 (anything
else); its traceback goes to the run's ``train.log`` only. ``HYDRA_FULL_ERROR=1`` or
``DRAFTSMITH_DEBUG=1`` re-raises it with the full traceback. Any other exception is a bug and keeps its
traceback.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NoReturn, TypeVar

from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf import DictConfig, OmegaConf

from train.config import ConfigError, unknown_key_message
from train.data.sources import DataError
from train.models.loading import CorruptModelError, TokenizerMismatchError, resolve_device
from train.renames import renamed_keys_of
from train.rundir import RunDirLocked
from train.training.callbacks import NonFiniteLossError

__all__ = [
    "USER_ERRORS",
    "add_device_arguments",
    "check_overrides",
    "debugging",
    "fail",
    "file_logs_on_rank_zero_only",
    "is_rank_zero",
    "quiet_console",
    "report_errors",
    "run_command",
]

log = logging.getLogger(__name__)

#: Errors whose message says what is wrong and what to do: printed as one line.
USER_ERRORS: tuple[type[BaseException], ...] = (
    ConfigError,
    FileNotFoundError,
    DataError,
    CorruptModelError,
    TokenizerMismatchError,
    RunDirLocked,
    NonFiniteLossError,
)
DEBUG_VARIABLES = ("HYDRA_FULL_ERROR", "DRAFTSMITH_DEBUG")

T = TypeVar("T")


#: Third-party warnings that say nothing to a user of draftsmith (deprecations inside libraries).
KNOWN_NOISE = (
    r".*'set_vital' is deprecated.*",  # torchdata's StatefulDataLoader on torch >= 2.9
    r".*isinstance\(treespec, LeafSpec\)` is deprecated.*",  # Lightning's _pytree on recent torch
)


def quiet_console() -> None:
    """Keep the terminal to what a user needs (the plan, progress bars, results, errors): Lightning's
    INFO lines go through the root logger (Hydra's ``train.log``; the console handler shows warnings
    and up, conf/hydra/default.yaml), library progress bars for loading and saving weights are off,
    and known library deprecation warnings are dropped. Only rank 0 writes the job's log file
    (:func:`file_logs_on_rank_zero_only`)."""
    import datasets
    import huggingface_hub
    import transformers

    for name in ("lightning", "lightning.pytorch", "lightning.fabric"):
        logger = logging.getLogger(name)
        for handler in list(logger.handlers):
            if type(handler) is logging.StreamHandler:
                logger.removeHandler(handler)
        logger.propagate = True
    transformers.utils.logging.disable_progress_bar()
    huggingface_hub.utils.disable_progress_bars()
    datasets.disable_progress_bars()
    for pattern in KNOWN_NOISE:
        warnings.filterwarnings("ignore", message=pattern)
    file_logs_on_rank_zero_only()
    warnings_to_log_file()


def is_rank_zero(environ: Mapping[str, str] = os.environ) -> bool:
    """Before a Trainer exists: the launcher's environment says which process this is."""
    return all(environ.get(var, "0") == "0" for var in ("RANK", "LOCAL_RANK", "NODE_RANK", "SLURM_PROCID"))


def file_logs_on_rank_zero_only(environ: Mapping[str, str] = os.environ) -> None:
    """Every rank of a DDP run starts the same Hydra job, whose file handler opens the same ``train.log``;
    rank 0 keeps it and the other ranks close theirs, so the log holds one copy of each line, not one per
    rank interleaved (their warnings and errors still reach their terminal)."""
    if is_rank_zero(environ):
        return
    root = logging.getLogger()
    for handler in list(root.handlers):
        if isinstance(handler, logging.FileHandler):
            root.removeHandler(handler)
            handler.close()


def warnings_to_log_file() -> None:
    """Python warnings (library FutureWarnings, Lightning's hints) go to the job's log file only.

    They are logged by ``py.warnings`` to the root logger's file handlers (Hydra's ``train.log``), not to
    its console handler, which shows our own warnings and errors."""
    logging.captureWarnings(True)
    captured = logging.getLogger("py.warnings")
    captured.propagate = False
    for handler in list(captured.handlers):
        captured.removeHandler(handler)
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler):
            captured.addHandler(handler)
    if not captured.handlers:  # no log file (a bare script): keep them off the terminal all the same
        captured.addHandler(logging.NullHandler())


def device_argument(flag: str) -> Callable[[str], Any]:
    """An argparse ``type`` for a device flag: :func:`train.models.loading.resolve_device` (``auto`` is CUDA
    when available), its error becoming argparse's one line naming ``flag`` (exit 2)."""

    def parse(value: str) -> Any:
        try:
            return resolve_device(value, flag)
        except ConfigError as err:
            raise argparse.ArgumentTypeError(str(err)) from None

    return parse


def add_device_arguments(parser: argparse.ArgumentParser, drafter: bool = True) -> None:
    """``--device`` (where the verifier decodes; default auto: CUDA when available, else the CPU) and, for
    scripts with a drafter model, ``--drafter-device`` (default: the verifier's): the argparse scripts'
    form of ``device=`` / ``drafter_device=`` (scripts/evaluate.py), checked when the flags are parsed."""
    parser.add_argument(
        "--device",
        type=device_argument("--device"),
        default="auto",
        help="where the verifier decodes: auto (CUDA when available), cpu, cuda, cuda:N",
    )
    if drafter:
        parser.add_argument(
            "--drafter-device",
            type=device_argument("--drafter-device"),
            default=None,
            help="where the drafter decodes (default: the verifier's device)",
        )


def run_command(fn: Callable[..., T], *args: Any) -> T:
    """What every entry point does with its Hydra config: a quiet console, then :func:`report_errors`."""
    quiet_console()
    return report_errors(fn, *args)


def debugging() -> bool:
    return any(os.environ.get(var, "") not in ("", "0") for var in DEBUG_VARIABLES)


def report_errors(fn: Callable[..., T], *args: Any) -> T:
    """Call ``fn(*args)``; an expected error becomes one line on stderr and an exit status."""
    try:
        return fn(*args)
    except USER_ERRORS as err:
        if debugging():
            raise
        _log_to_files_only(err)
        fail(str(err), 2 if isinstance(err, ConfigError) else 1)


def fail(message: str, status: int = 1) -> NoReturn:
    print(f"error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(status)


def _log_to_files_only(err: BaseException) -> None:
    """The traceback goes to the job's log file (Hydra's ``train.log``), not to the terminal."""
    record = log.makeRecord(
        log.name, logging.ERROR, __file__, 0, "run failed: %s", (err,), (type(err), err, err.__traceback__)
    )
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler):
            handler.handle(record)


def check_overrides(config_dir: str, config_name: str, argv: Sequence[str]) -> list[str]:
    """Before Hydra starts the job: an override of a key the config lacks (a typo such as
    ``method.divergance=fkl``) exits 2 naming the valid keys, instead of Hydra's advice to append it
    with ``+``. An override of a renamed key (:data:`train.renames.RENAMED_KEYS`, such as
    ``method.cache_teacher=false``) is kept as an addition (``+``) that instantiation renames, with its
    deprecation line. Returns the overrides the job runs with (``argv``, renamed keys prefixed). Only plain
    single runs are checked (no ``-m`` sweeps or Hydra flags); any other composition problem is left to
    Hydra's own report."""
    if any(a.startswith("-") for a in argv):
        return list(argv)
    overrides = [a for a in argv if not a.lstrip("+~").startswith("hydra.")]
    try:
        with initialize_config_dir(config_dir=os.path.abspath(config_dir), version_base="1.3"):
            compose(config_name=config_name, overrides=overrides)
    except ConfigCompositionException as err:
        key = getattr(err.__cause__, "full_key", None)
        if not key or "not in struct" not in str(err.__cause__) and "Could not override" not in str(err):
            return list(argv)
        culprit = [o for o in overrides if o.split("=", 1)[0] == key]
        # the others checked first: another renamed key among them must not hide this one's node
        rest = check_overrides(config_dir, config_name, [o for o in overrides if o not in culprit])
        try:
            with initialize_config_dir(config_dir=os.path.abspath(config_dir), version_base="1.3"):
                cfg = compose(config_name=config_name, overrides=rest)
        except Exception:
            return list(argv)
        parent, _, leaf = key.rpartition(".")
        node = OmegaConf.select(cfg, parent) if parent else cfg
        if node is not None and not isinstance(node, DictConfig):
            return list(argv)
        if node is not None and culprit and leaf in renamed_keys_of(node.get("_target_")):
            return check_overrides(config_dir, config_name, [f"+{a}" if a in culprit else a for a in argv])
        valid = [str(k) for k in node if not str(k).startswith("_")] if node is not None else []
        fail(unknown_key_message(key, valid), 2)
    return list(argv)
