"""The run directory's life: one live run holds it (a lock file), and a run that fails before it
wrote anything worth keeping takes its directory away again.

The lock is a file created with ``O_CREAT | O_EXCL`` (atomic on local and NFSv3+ filesystems) that
holds the owner's host, PID and start time as JSON. A lock left by a process that died on this host is
taken over with a warning, and so is one left by an earlier run of this same SLURM job (a requeued job
restarts on any node with a higher ``SLURM_RESTART_COUNT``); any other lock held by another host cannot
be checked and blocks.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import shutil
import socket
import time
from collections.abc import Sequence
from datetime import datetime
from typing import Any

import psutil
from omegaconf import OmegaConf

log = logging.getLogger(__name__)

LOCK_NAME = "run.lock"
DISPOSABLE = (".hydra", "config.yaml")
"""What a run directory may hold (besides its ``*.log`` files) and still be removed after a failure."""


class RunDirLocked(RuntimeError):
    """Another live run holds this run directory."""


def _read_holder(path: str) -> dict[str, Any]:
    try:
        with open(path) as f:
            holder = json.load(f)
        return holder if isinstance(holder, dict) else {}
    except (OSError, ValueError):
        return {}  # unreadable or half-written: judged by what is known (nothing)


def _slurm_job() -> tuple[str | None, int]:
    """This process's SLURM job id (None off SLURM) and how often the job was requeued."""
    return os.environ.get("SLURM_JOB_ID"), int(os.environ.get("SLURM_RESTART_COUNT") or 0)


def _is_dead(holder: dict[str, Any]) -> bool:
    """True only when the holder is known to be gone: it ran on this host and its PID is no longer a
    live process, or it was an earlier run of this same (requeued) SLURM job."""
    job, restart = _slurm_job()
    if job is not None and holder.get("slurm_job_id") == job:
        return int(holder.get("slurm_restart_count") or 0) < restart
    if holder.get("host") != socket.gethostname() or not isinstance(holder.get("pid"), int):
        return False
    return not psutil.pid_exists(holder["pid"])


def _describe(holder: dict[str, Any]) -> str:
    since = holder.get("since")
    when = (
        datetime.fromtimestamp(since).isoformat(timespec="seconds")
        if isinstance(since, (int, float))
        else "?"
    )
    return f"host {holder.get('host', '?')}, PID {holder.get('pid', '?')}, since {when}"


class RunDirLock:
    """Hold ``<run_dir>/run.lock`` while a run uses the directory; use as a context manager.

    A second run given the same directory fails at once with :class:`RunDirLocked` naming the holder.
    """

    def __init__(self, run_dir: str) -> None:
        self.path = os.path.join(run_dir, LOCK_NAME)
        self.held = False

    def acquire(self) -> None:
        record: dict[str, Any] = {"host": socket.gethostname(), "pid": os.getpid(), "since": time.time()}
        job, restart = _slurm_job()
        if job is not None:
            record |= {"slurm_job_id": job, "slurm_restart_count": restart}
        for _ in range(2):  # a second try after removing a dead holder's lock
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                holder = _read_holder(self.path)
                if not _is_dead(holder):
                    raise RunDirLocked(
                        f"run directory {os.path.dirname(self.path)} is in use by another run "
                        f"({_describe(holder)}); give this run its own hydra.run.dir, or delete "
                        f"{self.path} if that run is gone"
                    ) from None
                log.warning("Taking over %s from a run that is gone (%s)", self.path, _describe(holder))
                os.remove(self.path)
                continue
            with os.fdopen(fd, "w") as f:
                json.dump(record, f)
            self.held = True
            return
        raise RunDirLocked(f"could not take {self.path}: another run took it first")

    def release(self) -> None:
        if self.held:
            self.held = False
            if _read_holder(self.path).get("pid") == os.getpid():
                os.remove(self.path)

    def __enter__(self) -> RunDirLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def remove_if_unused(run_dir: str, created_by_us: bool = False) -> bool:
    """Remove ``run_dir`` if this process made it and it holds nothing worth keeping.

    Made by this process: ``created_by_us``, or Hydra created its ``.hydra/`` after this process
    started (Hydra rewrites the files of a reused directory but does not recreate the folder).
    Nothing worth keeping: only ``.hydra/``, ``config.yaml`` and the job's ``*.log`` files, none of
    them older than this process. The log then holds only this run's lines; the error that ended the
    run went to the terminal. Returns whether the directory was removed.
    """
    if not os.path.isdir(run_dir):
        return False
    started = psutil.Process().create_time() - 1.0  # file times and process times differ in resolution
    hydra_dir = os.path.join(run_dir, ".hydra")
    if not created_by_us and not (os.path.isdir(hydra_dir) and os.stat(hydra_dir).st_mtime >= started):
        return False
    for entry in os.scandir(run_dir):
        is_log = entry.name.endswith(".log") and entry.is_file()
        if not is_log and entry.name not in DISPOSABLE:
            return False
        if entry.stat().st_mtime < started:
            return False
    shutil.rmtree(run_dir, ignore_errors=True)
    return True


def newest_artifact(checkpoints_dir: str, experiment: str, verifier: str | None, artifact: str) -> str | None:
    """``<checkpoints_dir>/<experiment>/<run>/<artifact>`` of the newest finished run, or None. The one rule
    every "newest run" lookup follows (the leaderboard, the methods that start from another run, the
    research scripts):

    - finished: the artifact holds a ``config.json`` (exports write it last);
    - of this verifier, when ``verifier`` is given: the run's ``config.yaml`` names it as ``model.verifier``;
    - newest: run directories are named by their start time, so the greatest name wins, whichever of the
      experiments ``experiment`` matches when it is a glob (``medusa*``)."""
    pattern = os.path.join(glob.escape(checkpoints_dir), experiment, "*", artifact, "config.json")
    runs = [os.path.dirname(os.path.dirname(found)) for found in glob.glob(pattern)]
    for run in sorted(runs, key=lambda run: (os.path.basename(run), run), reverse=True):
        if verifier is None or _run_verifier(run) == os.path.abspath(str(verifier)):
            return os.path.join(run, artifact)
    return None


def _run_verifier(run: str) -> str | None:
    """The absolute ``model.verifier`` of the run's ``config.yaml``; None for an unreadable or foreign run."""
    try:
        return os.path.abspath(str(OmegaConf.load(os.path.join(run, "config.yaml")).model.verifier))
    except Exception:  # an unreadable or foreign run is not a candidate
        return None


def newest_artifact_of(
    checkpoints_dir: str, experiments: Sequence[str], verifier: str, artifact: str
) -> str | None:
    """:func:`newest_artifact` of the first of ``experiments`` that has one (e.g. a recipe, then its
    tiny-pair twin)."""
    found = (newest_artifact(checkpoints_dir, name, verifier, artifact) for name in experiments)
    return next((f for f in found if f is not None), None)
