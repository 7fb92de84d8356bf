"""Progress of the long stages: a bar on a terminal, one log line per interval in a Job's log.

On a terminal (stderr is a TTY) a stage shows a bar with steps done of the total and an ETA:
transformers' own for SFT and GRPO (their Trainer's ``ProgressCallback``), tqdm for the rest
(generation in evaluations, gates and RSFT sampling; uploads when staging a model or publishing a
checkpoint). Where stderr is not a terminal (``kubectl logs``, CI, a pipe) a bar's carriage returns
would fill the log, so the same progress is one plain line every :data:`LOG_INTERVAL_S` seconds,
plus the first and the last::

    [grpo] step 40/200 (20%), 812 s elapsed, ETA 3248 s, loss 0.0123, reward 0.412

``ORTHORL_PROGRESS`` overrides the choice: ``bar``, ``log`` or ``off``; ``ORTHORL_PROGRESS_INTERVAL``
sets the interval (seconds). :func:`progress_mode` and :func:`log_due` are the decisions, pure.
"""

from __future__ import annotations

import math
import os
import sys
import time
from collections.abc import Callable, Mapping, MutableMapping
from typing import Any, TextIO

MODES: tuple[str, ...] = ("bar", "log", "off")
LOG_INTERVAL_S: float = 30.0
"""Seconds between two progress lines in log mode."""
TRAINER_LOG_KEYS: tuple[str, ...] = ("loss", "reward", "mean_token_accuracy")
"""Trainer metrics a log-mode progress line carries when the last log has them."""


def progress_mode(isatty: bool, env: Mapping[str, str]) -> str:
    """``bar`` on a terminal, ``log`` otherwise; ``ORTHORL_PROGRESS`` (one of :data:`MODES`) wins.
    An unknown value is refused with what to set instead."""
    chosen = env.get("ORTHORL_PROGRESS", "").strip().lower()
    if chosen:
        if chosen not in MODES:
            raise ValueError(
                f"ORTHORL_PROGRESS={chosen!r}: use one of {', '.join(MODES)} (or leave it unset)"
            )
        return chosen
    return "bar" if isatty else "log"


def log_interval(env: Mapping[str, str]) -> float:
    """Seconds between progress lines (``ORTHORL_PROGRESS_INTERVAL``, default LOG_INTERVAL_S)."""
    raw = env.get("ORTHORL_PROGRESS_INTERVAL", "")
    if not raw:
        return LOG_INTERVAL_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value >= 0 or not math.isfinite(value):
        raise ValueError(f"ORTHORL_PROGRESS_INTERVAL={raw!r}: use a number of seconds >= 0")
    return value


def current_mode(stream: TextIO | None = None, env: Mapping[str, str] | None = None) -> str:
    """:func:`progress_mode` of this process (stderr's TTY-ness and the environment)."""
    stream = sys.stderr if stream is None else stream
    isatty = getattr(stream, "isatty", None)
    return progress_mode(bool(isatty and isatty()), os.environ if env is None else env)


def log_due(now: float, last: float | None, interval: float, done: int, total: int) -> bool:
    """Whether a log-mode line is due: the first update, the last (``done >= total``), and then
    once ``interval`` seconds have passed since the previous line (``last``, None before any)."""
    return last is None or done >= total or now - last >= interval


def format_line(
    desc: str,
    done: int,
    total: int,
    elapsed: float,
    unit: str = "step",
    extra: Mapping[str, float] | None = None,
) -> str:
    """A log-mode line: ``[desc] unit done/total (pct), elapsed, ETA`` (linear in the rate so far),
    then ``extra``'s values."""
    pct = 100.0 * done / total if total else 100.0
    count = f"{done / 1e6:.1f}/{total / 1e6:.1f} MB" if unit == "B" else f"{unit} {done}/{total}"
    line = f"[{desc}] {count} ({pct:.0f}%), {elapsed:.0f} s elapsed"
    if 0 < done < total:
        line += f", ETA {elapsed / done * (total - done):.0f} s"
    elif done >= total:
        line += ", done"
    for key, value in (extra or {}).items():
        line += f", {key} {value:.4g}"
    return line


class Progress:
    """Progress of ``total`` units of work: a tqdm bar (bar mode), log lines (log mode) or nothing.

    ``update(n)`` after each piece, ``close()`` at the end (or use it as a context manager).
    ``emit``: where log-mode lines go (default: stderr, flushed); ``clock``: seconds (tests).
    """

    def __init__(
        self,
        total: int,
        desc: str,
        unit: str = "step",
        mode: str | None = None,
        interval: float | None = None,
        emit: Callable[[str], Any] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.total = int(total)
        self.desc = desc
        self.unit = unit
        self.mode = current_mode() if mode is None else mode
        self.interval = log_interval(os.environ) if interval is None else interval
        self.emit = emit or _stderr_line
        self.clock = clock
        self.done = 0
        self.start = clock()
        self.last: float | None = None
        self.lines = 0
        self._bar = None
        if self.mode == "bar":
            from tqdm.auto import tqdm

            self._bar = tqdm(
                total=self.total, desc=desc, unit=unit, unit_scale=unit == "B", dynamic_ncols=True
            )

    def update(self, n: int = 1, extra: Mapping[str, float] | None = None) -> None:
        self.done = min(self.done + int(n), self.total) if self.total else self.done + int(n)
        if self._bar is not None:
            self._bar.update(n)
            if extra:
                self._bar.set_postfix({k: f"{v:.4g}" for k, v in extra.items()}, refresh=False)
        elif self.mode == "log":
            now = self.clock()
            if log_due(now, self.last, self.interval, self.done, self.total):
                self.emit(format_line(self.desc, self.done, self.total, now - self.start, self.unit, extra))
                self.last = now
                self.lines += 1

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _stderr_line(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def progress(total: int, desc: str, unit: str = "step") -> Progress:
    """A :class:`Progress` in this process's mode (:func:`current_mode`)."""
    return Progress(total, desc, unit)


def trainer_bars() -> bool:
    """Whether a transformers Trainer should draw its own bar (``disable_tqdm=not trainer_bars()``)."""
    return current_mode() == "bar"


def log_progress_callback(desc: str, interval: float | None = None, emit: Callable[[str], Any] | None = None):
    """A TrainerCallback writing a log-mode line (optimizer steps of ``max_steps``, ETA, the last
    loss / reward) once per interval (:func:`attach` puts it in place of transformers' PrinterCallback,
    which prints every log dict when the Trainer's bar is off)."""
    from transformers import TrainerCallback

    class LogProgress(TrainerCallback):
        def __init__(self):
            self.progress: Progress | None = None
            self.latest: dict[str, float] = {}

        def on_train_begin(self, args, state, control, **kwargs):
            self.progress = Progress(state.max_steps, desc, "step", mode="log", interval=interval, emit=emit)
            self.progress.done = state.global_step  # resumed runs start part-way

        def on_log(self, args, state, control, logs=None, **kwargs):
            for key in TRAINER_LOG_KEYS:
                value = (logs or {}).get(key)
                if isinstance(value, (int, float)) and math.isfinite(value):
                    self.latest[key] = float(value)

        def on_step_end(self, args, state, control, **kwargs):
            if self.progress is not None:
                self.progress.update(state.global_step - self.progress.done, self.latest)

    return LogProgress()


LIBRARY_BAR_SWITCHES: tuple[str, ...] = ("HF_HUB_DISABLE_PROGRESS_BARS", "HF_DATASETS_DISABLE_PROGRESS_BARS")
"""Environment switches that turn off the bars huggingface_hub (downloads, and transformers' weight
loading, which follows it) and datasets (map, downloads) draw themselves; each is read when its
library is imported."""


def quiet_library_bars(env: MutableMapping[str, str] | None = None) -> None:
    """Outside a terminal (log or off mode), turn the other libraries' own bars off: their carriage
    returns would fill a Job's log, and this project's log lines already say where a stage is. Call it
    before transformers, datasets or huggingface_hub are imported (the CLI's and the Job's start); a
    switch the user set is left as it is."""
    env = os.environ if env is None else env
    if current_mode(env=env) == "bar":
        return
    for name in LIBRARY_BAR_SWITCHES:
        env.setdefault(name, "1")


def attach(trainer, desc: str) -> None:
    """Give a built Trainer this process's progress: in log mode the log-line callback in place of
    transformers' PrinterCallback; in bar mode nothing (its ProgressCallback is there when
    ``disable_tqdm`` is False)."""
    if current_mode() != "log":
        return
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    trainer.remove_callback(PrinterCallback)
    trainer.remove_callback(ProgressCallback)
    trainer.add_callback(log_progress_callback(desc))


__all__ = [
    "LOG_INTERVAL_S",
    "MODES",
    "Progress",
    "attach",
    "current_mode",
    "format_line",
    "log_due",
    "log_progress_callback",
    "progress",
    "progress_mode",
    "quiet_library_bars",
    "trainer_bars",
]
