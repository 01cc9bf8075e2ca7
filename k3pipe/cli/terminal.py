"""What a ``k3pipe`` command shows on the terminal, and how it ends on a signal.

- **Errors:** one clear ``error: ...`` message and a non-zero exit; the traceback goes to the log file
  ``K3PIPE_HOME/logs/k3pipe.log`` (and to the terminal with ``--debug``). Prefect's console lines keep
  their one-line messages, without the tracebacks it attaches.
- **Signals** (:class:`Interrupts`): the first Ctrl-C (SIGINT) or SIGTERM raises
  ``KeyboardInterrupt`` where the command is, so that every teardown runs (the engine stopped, the
  measured requests recorded, the MLflow run ended KILLED); another Ctrl-C while that runs is said to
  be pending and does not cut the teardown short. If the teardown has not ended after
  ``deadline_s``, the command ends the process groups it started and exits anyway. Exit codes: 130
  (SIGINT), 143 (SIGTERM).
"""

from __future__ import annotations

import logging
import logging.handlers
import os
import signal
import sys
import threading
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import ClassVar

__all__ = ["Interrupts", "configure_logging", "hide_tracebacks", "log_error", "log_path"]

_log = logging.getLogger("k3pipe.cli")
_state: dict[str, object] = {"debug": False, "log": None}


def log_path() -> Path | None:
    """The command's log file (None before :func:`configure_logging`)."""
    value = _state["log"]
    return value if isinstance(value, Path) else None


def configure_logging(home: Path, debug: bool) -> Path:
    """k3pipe's log file under ``home`` (rotated at 10 MB), for every command; returns its path."""
    _state["debug"] = debug
    path = home / "logs" / "k3pipe.log"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handler: logging.Handler = logging.handlers.RotatingFileHandler(
            path, maxBytes=10 * 2**20, backupCount=3, encoding="utf-8"
        )
    except OSError:
        handler = logging.NullHandler()  # an unwritable home: the error says so elsewhere
    handler.setFormatter(logging.Formatter("%(asctime)s %(process)d %(levelname)s %(name)s: %(message)s"))
    handler.setLevel(logging.DEBUG)
    # not on the root logger: Prefect leaves its console out when it finds a handler there
    logging.getLogger("k3pipe").addHandler(handler)  # the library's and the shell's (k3pipe.cli ...)
    logging.getLogger("k3pipe").setLevel(logging.DEBUG if debug else logging.INFO)
    # the command's own records (errors with tracebacks) go to the file only: the terminal gets
    # one message from main()
    _log.addHandler(handler)
    _log.propagate = False
    _state["log"], _state["handler"] = path, handler
    _log.info("k3pipe %s (pid %d)", " ".join(sys.argv[1:]), os.getpid())
    return path


def log_error(exc: BaseException) -> None:
    """The whole error, traceback included, into the log file (and to stderr with --debug)."""
    if log_path() is not None:
        _log.error("%s: %s", type(exc).__name__, exc, exc_info=exc)
    if _state["debug"]:
        traceback.print_exception(exc, file=sys.stderr)


class _WithoutTraceback(logging.Formatter):
    """A console formatter that leaves out the traceback a record carries (the log file keeps it)."""

    def __init__(self, inner: logging.Formatter | None) -> None:
        super().__init__()
        self.inner = inner or logging.Formatter()

    def format(self, record: logging.LogRecord) -> str:
        saved = record.exc_info, record.exc_text, record.stack_info
        record.exc_info, record.exc_text, record.stack_info = None, None, None
        try:
            return self.inner.format(record)
        finally:
            record.exc_info, record.exc_text, record.stack_info = saved


def hide_tracebacks() -> None:
    """Once Prefect has set up its logging: its records go to the log file too, and its console
    handlers print one line per record, no traceback (unless --debug); the records, tracebacks
    included, still reach the log file and Prefect's API."""
    handler = _state.get("handler")
    prefect = logging.getLogger("prefect")
    if isinstance(handler, logging.Handler) and handler not in prefect.handlers:
        prefect.addHandler(handler)
    if _state["debug"]:
        return
    loggers = [logging.getLogger(), *(logging.getLogger(n) for n in list(logging.root.manager.loggerDict))]
    for logger in loggers:
        for handler in getattr(logger, "handlers", []):
            console = isinstance(handler, logging.StreamHandler) and not isinstance(
                handler, logging.FileHandler
            )
            if console and not isinstance(handler.formatter, _WithoutTraceback):
                handler.setFormatter(_WithoutTraceback(handler.formatter))


class Interrupts:
    """SIGINT and SIGTERM for the length of a flow (see the module's docstring)."""

    EXIT_CODES: ClassVar[dict[signal.Signals, int]] = {signal.SIGINT: 130, signal.SIGTERM: 143}

    def __init__(self, deadline_s: float = 9.0, on_deadline: Callable[[], None] | None = None) -> None:
        self.deadline_s = deadline_s
        self.received: signal.Signals | None = None
        self.on_deadline = on_deadline
        self._previous: dict[signal.Signals, object] = {}
        self._timer: threading.Timer | None = None

    @property
    def exit_code(self) -> int:
        return self.EXIT_CODES.get(self.received or signal.SIGINT, 130)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        sig = signal.Signals(signum)
        if self.received is not None:
            print(
                f"\n{sig.name} again: still stopping the engine and recording what was measured "
                f"(at most {self.deadline_s:.0f} s in all)",
                file=sys.stderr,
                flush=True,
            )
            return
        self.received = sig
        how = "Ctrl-C" if sig == signal.SIGINT else sig.name
        print(f"\n{how}: stopping the engine and recording what was measured...", file=sys.stderr, flush=True)
        self._timer = threading.Timer(self.deadline_s, self._give_up)
        self._timer.daemon = True
        self._timer.start()
        raise KeyboardInterrupt(f"interrupted by {sig.name}")

    def _give_up(self) -> None:
        """The teardown overran its deadline: end what this process started, then exit."""
        if self.on_deadline is not None:
            try:
                self.on_deadline()
            except Exception as exc:  # the exit below must happen whatever
                _log.error("ending this run's process groups failed: %s", exc)
        print(
            f"error: the teardown took longer than {self.deadline_s:.0f} s; this command's engines "
            "were ended, and `k3pipe sync` pushes what was recorded locally",
            file=sys.stderr,
            flush=True,
        )
        logging.shutdown()
        os._exit(self.exit_code)

    @contextmanager
    def installed(self) -> Iterator[Interrupts]:
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, self._handle)
        try:
            yield self
        finally:
            # after an interrupt the handlers stay: a signal more, while the command still ends
            # (its temporary Prefect server stopped at exit), is said to be pending, not raised
            if self.received is None:
                for sig, handler in self._previous.items():
                    signal.signal(sig, handler)  # type: ignore[arg-type]
            if self._timer is not None and self.received is None:
                self._timer.cancel()
