"""A torch.profiler session around model steps, shared by the scheduler process and the offline `LLM`.

`start()` opens the profiler; the owner calls `on_step()` after each model step (each becomes a
`ProfilerStep#N` range in the trace); `stop()` writes one Chrome/Perfetto trace
(`<dir>/ftransformers-<time>-<pid>-<n>.trace.json.gz`) and returns its path. With `num_steps`,
`on_step()` stops by itself after that many steps and returns the path.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from collections.abc import Sequence
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

PROFILE_DIR_ENV = "FTRANSFORMERS_PROFILE_DIR"
DEFAULT_PROFILE_DIR = "ftransformers-profiles"
ACTIVITIES = ("CPU", "GPU", "CUDA")  # GPU and CUDA are the same; dropped where no CUDA device exists


class ProfilerError(RuntimeError):
    """The profiler cannot do what was asked; one line fit to show a user."""


def resolve_profile_dir(output_dir: str | os.PathLike[str] | None, configured: str | None = None) -> Path:
    """`output_dir`, else --profile-dir, else $FTRANSFORMERS_PROFILE_DIR, else ./ftransformers-profiles."""
    chosen = output_dir or configured or os.environ.get(PROFILE_DIR_ENV) or DEFAULT_PROFILE_DIR
    return Path(chosen).expanduser().resolve()


def _activities(names: Sequence[str] | None) -> list[torch.profiler.ProfilerActivity]:
    names = ["CPU", "GPU"] if names is None else list(names)
    unknown = [n for n in names if str(n).upper() not in ACTIVITIES]
    if unknown or not names:
        raise ProfilerError(f"activities must be a non-empty list of {', '.join(ACTIVITIES[:2])}; got {names!r}")
    upper = {str(n).upper() for n in names}
    found = []
    if "CPU" in upper:
        found.append(torch.profiler.ProfilerActivity.CPU)
    if upper & {"GPU", "CUDA"} and torch.cuda.is_available():
        found.append(torch.profiler.ProfilerActivity.CUDA)
    if not found:
        raise ProfilerError("activities: no CUDA device here to profile; add 'CPU'")
    return found


def _check_writable(directory: Path) -> None:
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe = directory / f".ftransformers-write-test-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise ProfilerError(f"cannot write profiles to {directory}: {exc.strerror or exc}") from None


def _record_always(step: int) -> torch.profiler.ProfilerAction:
    return torch.profiler.ProfilerAction.RECORD


class StepProfiler:
    _counter = itertools.count()

    def __init__(self, configured_dir: str | None = None) -> None:
        self.configured_dir = configured_dir  # --profile-dir
        self._prof: torch.profiler.profile | None = None
        self._path: Path | None = None
        self._steps_left: int | None = None
        self.steps = 0
        self.last_path: Path | None = None  # the last trace written

    @property
    def active(self) -> bool:
        return self._prof is not None

    @property
    def path(self) -> Path | None:
        """Where the running session's trace goes."""
        return self._path

    def start(self, output_dir: str | os.PathLike[str] | None = None, num_steps: int | None = None,
              activities: Sequence[str] | None = None, record_shapes: bool = False,
              with_stack: bool = False) -> Path:
        """Start profiling; returns the trace file's future path."""
        if self._prof is not None:
            raise ProfilerError(f"already profiling (trace goes to {self._path}); call stop_profile first")
        if num_steps is not None and num_steps < 1:
            raise ProfilerError("num_steps must be at least 1")
        kinds = _activities(activities)
        directory = resolve_profile_dir(output_dir, self.configured_dir)
        _check_writable(directory)
        stamp = time.strftime("%Y%m%d-%H%M%S")
        path = directory / f"ftransformers-{stamp}-{os.getpid()}-{next(self._counter)}.trace.json.gz"
        # An always-RECORD schedule: one trace over every step, with a ProfilerStep#N range per step.
        prof = torch.profiler.profile(activities=kinds, schedule=_record_always, record_shapes=record_shapes,
                                      with_stack=with_stack)
        prof.start()
        self._prof, self._path, self._steps_left, self.steps = prof, path, num_steps, 0
        logger.info("profiling started (%s); trace goes to %s", f"{num_steps} steps" if num_steps else "until stop", path)
        return path

    def on_step(self) -> Path | None:
        """Mark the end of one model step; returns the trace path when `num_steps` ran out."""
        if self._prof is None:
            return None
        self.steps += 1
        if self._steps_left is not None:
            self._steps_left -= 1
            if self._steps_left <= 0:
                return self.stop()
        self._prof.step()  # closes ProfilerStep#N, opens the next (a manual stop ends the last one)
        return None

    def stop(self) -> Path:
        """Stop and write the trace; returns its path."""
        prof, path = self._prof, self._path
        if prof is None or path is None:
            raise ProfilerError("not profiling; call start_profile first")
        self._prof, self._path, self._steps_left = None, None, None
        prof.stop()
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            prof.export_chrome_trace(str(path))
        except OSError as exc:
            raise ProfilerError(f"cannot write the trace to {path}: {exc.strerror or exc}") from None
        self.last_path = path
        logger.info("profile trace (%d steps) written to %s", self.steps, path)
        return path
