"""The one entry helper: how every tandem process parses, loads its config, names itself and logs.

An entry point reads::

    args = cli.config_parser("python -m actor", __doc__).parse_args(argv)   # --config PATH + key=value ...
    if (cfg := cli.load(args.config, args.overrides)) is None:
        return cli.EXIT_USAGE                        # every config problem already printed, at once
    cli.setup_process("actor-r0-1")                  # process name + the one log format
    from actor.loop import ActorLoop                 # heavy imports only now
    return ActorLoop(cfg, ...).run()

One log format for every process (:data:`LOG_FORMAT`), so the merged logs of a run read alike and
one process is found with one grep (docs/runbook.md, Logs)::

    2026-05-01 12:00:03,141 INFO [learner r1 48213] learner.train: step 12 ...
    2026-05-01 12:00:03,150 WARNING [actor-r1-0 48250] actor.loop: server ... unreachable

What this module does not know: torch, transformers, or what any process does. It imports only the
standard library at import time (``common.config`` on the first :func:`load`), so ``--help`` answers
in a fraction of a second.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any, Callable, Sequence

#: Exit code of a bad command line or config (argparse's own, and every entry point's).
EXIT_USAGE = 2

#: ``{tag}`` is ``<process-name>`` or ``<process-name> r<rank>`` (see :func:`log_format`).
LOG_FORMAT = "%(asctime)s %(levelname)s [{tag} %(process)d] %(name)s: %(message)s"

#: Libraries whose INFO lines drown a process's own log (httpx: one line per request).
QUIET_LOGGERS = ("httpx", "httpcore")

PR_SET_NAME = 15  # linux/prctl.h
_COMM_LEN = 15  # the kernel keeps 15 characters of a process name


class _ConfigParser(argparse.ArgumentParser):
    """Overrides may come before, between or after the flags: ``--config C a=1 --dry-run b=2``."""

    def parse_args(  # type: ignore[override]
            self, args: Sequence[str] | None = None, namespace: Any = None) -> argparse.Namespace:
        return self.parse_intermixed_args(args, namespace)


def parser(prog: str, doc: str | None, **kwargs: Any) -> argparse.ArgumentParser:
    """An argument parser whose description is the first paragraph of the module docstring ``doc``."""
    return _make(argparse.ArgumentParser, prog, doc, **kwargs)


def config_parser(prog: str, doc: str | None, *, config_help: str = "the run's YAML (configs/..., see docs/config.md)",
                  config_required: bool = True, **kwargs: Any) -> argparse.ArgumentParser:
    """A parser for ``--config PATH [dotted.key=value ...]`` entry points; add the process's own flags to it.

    The overrides land in ``args.overrides`` (OmegaConf dotted keys, e.g. ``training.max_steps=10``).
    """
    ap = _make(_ConfigParser, prog, doc, **kwargs)
    ap.add_argument("--config", required=config_required, metavar="PATH", help=config_help)
    ap.add_argument("overrides", nargs="*", metavar="key=value", help="dotted config overrides, e.g. training.max_steps=10")
    return ap


def _make(cls: type[argparse.ArgumentParser], prog: str, doc: str | None, **kwargs: Any) -> argparse.ArgumentParser:
    kwargs.setdefault("description", (doc or "").strip().split("\n\n")[0] or None)
    kwargs.setdefault("formatter_class", argparse.RawDescriptionHelpFormatter)
    return cls(prog=prog, **kwargs)


def load(path: str | None, overrides: Sequence[str] = (), *, loader: Callable[..., Any] | None = None,
         **kwargs: Any) -> Any | None:
    """The validated config, or ``None`` once every problem is printed to stderr (exit :data:`EXIT_USAGE`).

    ``loader`` defaults to :func:`common.config.load.load_config` (``kwargs`` go to it, e.g. ``world_size``);
    Stage-B passes its own. Each problem names the dotted key, the value and the fix.
    """
    from common.config.load import ConfigError, load_config  # deferred: --help never pays for it

    try:
        return (loader or load_config)(path, list(overrides), **kwargs)
    except ConfigError as err:
        print(err, file=sys.stderr)
        return None


def torchrun_rank() -> tuple[int, int]:
    """(rank, world size) that torchrun announced (``RANK``, ``WORLD_SIZE``); (0, 1) without torchrun."""
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def log_format(name: str, rank: int | None = None) -> str:
    """:data:`LOG_FORMAT` for process ``name`` (and learner/Stage-B ``rank`` where there is one)."""
    return LOG_FORMAT.replace("{tag}", name if rank is None else f"{name} r{rank}")


def setup_logging(name: str, rank: int | None = None, level: int | str = logging.INFO) -> None:
    """Root logging to stderr in the one format; quiets :data:`QUIET_LOGGERS` below WARNING.

    Like ``logging.basicConfig``, it leaves a root logger that already has handlers alone (pytest's).
    """
    logging.basicConfig(level=level.upper() if isinstance(level, str) else level, stream=sys.stderr,
                        format=log_format(name, rank))
    for noisy in QUIET_LOGGERS:
        logging.getLogger(noisy).setLevel(logging.WARNING)


def name_process(title: str) -> None:
    """Show ``title`` in ``ps -o comm``/``top`` (prctl; 15 characters) and ``tandem-<title>`` in ``ps``
    (setproctitle, when installed). Best effort: nothing fails for want of either."""
    try:
        import ctypes

        ctypes.CDLL(None).prctl(PR_SET_NAME, title.encode()[:_COMM_LEN], 0, 0, 0)
    except (OSError, AttributeError):  # not Linux
        pass
    try:
        import setproctitle  # optional dependency

        setproctitle.setproctitle(f"tandem-{title}")
    except ImportError:
        pass


def setup_process(name: str, rank: int | None = None, level: int | str = logging.INFO) -> None:
    """Name the process (``name`` or ``name-r<rank>``) and start its log: the call after the config is good."""
    name_process(name if rank is None else f"{name}-r{rank}")
    setup_logging(name, rank, level)
