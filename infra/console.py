"""What a person sees on the terminal: each stage's own lines, not library chatter.

Libraries the stages run print notices that say nothing to someone running a
pipeline: MLflow's "View run at" links and schema set-up lines, DeepSpeed's
accelerator detection, safetensors' note on tied weights, Ray's start-up
warnings and its raylet's note on how many worker processes it started. They
still reach every stage's log file (``OUT/train.log``, Ray's session logs, MLflow's
store); only the terminal copy is filtered.
``crawl2chat -v`` (or ``CRAWL2CHAT_VERBOSE=1``) shows everything.
"""

from __future__ import annotations

import logging
import os
import re
import sys

VERBOSE_ENV = "CRAWL2CHAT_VERBOSE"

# Lines of a launched stage's output that are library notices, not progress or errors.
CHATTER = tuple(re.compile(p) for p in (
    r"Removed shared tensor \{.*\} while saving",  # safetensors on tied embeddings: expected, harmless
    r"\[real_accelerator\.py:\d+:get_accelerator\] Setting accelerator to CPU",  # DeepSpeed import on a CPU
    r"^\U0001F3C3 View run |^\U0001F9EA View experiment at",  # MLflow's links after each run
    r"INFO mlflow\.store\.db\.utils: (Creating initial MLflow database tables|Updating database tables)",
    r"INFO alembic\.runtime\.migration: ",
    r"Token authentication is (enabled|disabled) for this Ray cluster",
    r"Progress bars disabled\. To enable, set",
    # The raylet's note that it started more worker processes than CPUs: Ray Data's
    # tasks and actors on a small machine, expected (it stays in the raylet's log).
    r"WARNING: \d+ PYTHON worker processes have been started on node",
    # Ray Data looks once, as a dataset starts, for a free CPU; between two steps the
    # previous step's tasks may still be handing theirs back.
    r"The Ray cluster currently does not have any available CPUs\. The Dataset job will hang",
    # Prefect's events client at exit, while it sends the run's last events.
    r"Still processing items: \d+ items remaining",
    # warcio's note that it percent-encoded a record's URL; the document keeps the encoded URL.
    r"Replacing spaces in invalid WARC-Target-URI",
    # urllib3's note before each retry of a request to a tracking server that does not answer:
    # the command says in one line what became of it (MLflow's buffered points, or the end).
    r"^Retrying \(Retry\(total=\d+, .*\) after connection broken by",
))


def verbose() -> bool:
    return os.environ.get(VERBOSE_ENV, "").strip().lower() in ("1", "true", "yes")


def is_chatter(line: str) -> bool:
    """A library notice the terminal does not show unless verbose."""
    return not verbose() and any(p.search(line) for p in CHATTER)


class ChatterFilter(logging.Filter):
    """A logging filter for a terminal handler: holds back the records :func:`is_chatter` names."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            return not is_chatter(record.getMessage())
        except Exception:  # noqa: BLE001 - a record that cannot be formatted is shown as it is
            return True


def filter_terminal_handlers(logger_name: str) -> None:
    """Put a :class:`ChatterFilter` on the logger's terminal handlers (its file handlers keep everything)."""
    for handler in logging.getLogger(logger_name).handlers:
        terminal = isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler)
        if terminal and not any(isinstance(f, ChatterFilter) for f in handler.filters):
            handler.addFilter(ChatterFilter())


RUN_TRACES = "logs/flow-runs.log"  # under the project folder (home): flow and task runs' lines, library warnings


# Prefect's lines as a run fails or is stopped (SIGTERM, Ctrl-C), repeating what the command says.
RUN_END_LINES = ("Finished in state Failed", "Finished in state Crashed", "Crash detected!")


class RunTraceFilter(logging.Filter):
    """For a terminal handler: holds back what Prefect logs when a flow or task run fails
    or is stopped (the traceback, an ERROR record with ``exc_info``, and the lines of
    :data:`RUN_END_LINES`). The command's last line says what failed in one sentence;
    they stay in the run's logs (Prefect's API, the UI) and in ``HOME/logs/flow-runs.log``."""

    def filter(self, record: logging.LogRecord) -> bool:
        if verbose() or not record.name.startswith(("prefect.flow_runs", "prefect.task_runs")):
            return True
        if record.exc_info:
            return False
        try:
            return not (record.levelno >= logging.ERROR and record.getMessage().startswith(RUN_END_LINES))
        except Exception:  # noqa: BLE001 - a record that cannot be formatted is shown as it is
            return True


def outlive_output_reader() -> None:
    """In a flow run that a Prefect worker (or ``serve-flows``) started, whose stdout and stderr
    are pipes to that process: keep the run going if that process dies.

    A write to a pipe nobody reads fails (``BrokenPipeError`` at the next ``print``, and
    rich, under Prefect's console log handler, ends the process with ``SystemExit(1)``), so
    a killed worker turned a run that finished its training into a Failed one. Each of the
    two descriptors is put behind a pipe this process reads itself; a thread copies what
    comes through to the worker while it listens, and drops it once the worker is gone.
    What the run logs also goes to the API and ``HOME/logs/flow-runs.log``."""
    import atexit
    import stat
    import threading

    if not os.environ.get("PREFECT__FLOW_RUN_ID") or getattr(outlive_output_reader, "done", False):
        return
    outlive_output_reader.done = True
    copies = []
    for fd in (1, 2):
        try:
            if not stat.S_ISFIFO(os.fstat(fd).st_mode):
                continue
        except OSError:
            continue
        reader = os.dup(fd)  # the worker's end
        inner_read, inner_write = os.pipe()
        os.dup2(inner_write, fd)
        os.close(inner_write)
        state = {"listening": True}
        thread = threading.Thread(target=_copy_while_read, args=(inner_read, reader, state), daemon=True,
                                  name=f"output-copy-{fd}")
        thread.start()
        copies.append((fd, reader, thread, state))

    def drain() -> None:
        # At exit: what is still in the inner pipes reaches the worker (if it listens) first.
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        for fd, reader, thread, state in copies:
            # Closes this process's write end of the inner pipe; a worker gone gets nothing more.
            os.dup2(reader if state["listening"] else os.open(os.devnull, os.O_WRONLY), fd)
        for _, _, thread, _ in copies:
            thread.join(timeout=2.0)

    atexit.register(drain)


def _copy_while_read(source: int, target: int, state: dict) -> None:
    while chunk := os.read(source, 1 << 16):
        view = memoryview(chunk)
        while state["listening"] and view:
            try:
                view = view[os.write(target, view):]
            except OSError:  # the reader is gone (EPIPE): the rest is dropped
                state["listening"] = False
    os.close(source)


def keep_run_traces(home: str | os.PathLike) -> str:
    """Write this process's flow and task run log lines to ``HOME/logs/flow-runs.log`` and
    keep failed runs' tracebacks off the terminal (:class:`RunTraceFilter`); returns the
    log file's path. Called by each flow as it starts, when Prefect's own handlers exist."""
    from pathlib import Path

    outlive_output_reader()
    path = (Path(home) / RUN_TRACES).resolve()
    path.parent.mkdir(parents=True, exist_ok=True)
    # On the root logger: the flow and task runs' records reach it (Prefect's loggers
    # propagate), and so do the libraries' warnings the terminal holds back (ChatterFilter).
    root = logging.getLogger()
    if not any(isinstance(h, logging.FileHandler) and Path(h.baseFilename) == path for h in root.handlers):
        handler = logging.FileHandler(path, encoding="utf-8")
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        root.addHandler(handler)
    for logger in (root, logging.getLogger("prefect")):
        for handler in logger.handlers:
            terminal = isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler)
            if terminal and not any(isinstance(f, RunTraceFilter) for f in handler.filters):
                handler.addFilter(RunTraceFilter())
            if terminal and not any(isinstance(f, ChatterFilter) for f in handler.filters):
                handler.addFilter(ChatterFilter())
    return str(path)


def quiet_libraries() -> None:
    """Turn the libraries' own notices down in this process (and the ones it starts),
    unless verbose. Called by every entry point before the libraries load (a Prefect
    worker's flow run included, where the command line's set-up never ran)."""
    # The stages print their own progress; library progress bars (a model's "Loading
    # weights" bar in an evaluation) would interleave with it. As the command line sets.
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    if verbose():
        return
    os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")
    # Ray's C++ failure-signal handler turns a SIGTERM or Ctrl-C'd process into an abort
    # with a stack dump on the terminal (status 134 instead of 143); read as Ray is imported.
    os.environ.setdefault("RAY_DISABLE_FAILURE_SIGNAL_HANDLER", "1")
    os.environ.setdefault("MLFLOW_LOGGING_LEVEL", "WARNING")
    for name in ("mlflow.store.db.utils", "alembic.runtime.migration"):
        logging.getLogger(name).setLevel(logging.WARNING)
    # Ray's notices that its token authentication is on and that progress bars are
    # off (the data stage prints a line per step instead).
    for name in ("ray._private.authentication", "ray.data._internal.progress"):
        logging.getLogger(name).setLevel(logging.ERROR)
