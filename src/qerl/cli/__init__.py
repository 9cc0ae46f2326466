"""The `qerl` command line: one subcommand a module."""

from __future__ import annotations

import os
import signal
import sys


# ---- Ctrl-C and SIGTERM from the first moment ---------------------------------------------------------
# Before a command's run() begins nothing is written, so a signal there ends the process at once with
# its one line: no KeyboardInterrupt travels through torch's and transformers' imports, where one was
# seen turned into a traceback or swallowed (and then every step trained). From run() on, Ctrl-C is a
# KeyboardInterrupt the commands report, and a flag remembers it in case some library swallows it.
class _Signals:
    running = False      # a command's run() has begun (it may write: interrupts become KeyboardInterrupt)
    command = None       # the subcommand, once main() knows it
    received = None      # "SIGINT" once a Ctrl-C arrived while running
    installed = False
    previous: dict = {}
    unraisable = None    # sys.unraisablehook before ours


NAMES = ("inspect", "quantize", "export", "generate", "bench", "train", "sft", "eval", "plot", "study")


def _command_from(argv) -> str:
    command = next((a for a in argv if not a.startswith("-")), "")
    return command if command in NAMES else ""


def _on_signal(signum, frame):
    name = "SIGTERM" if signum == signal.SIGTERM else "SIGINT"
    if not _Signals.running:
        command = _Signals.command if _Signals.command is not None else _command_from(sys.argv[1:])
        try:  # os.write: the handler may run inside a print to stderr, whose buffer is not reentrant
            os.write(2, (interrupted_line(command, name) + "\n").encode())
        finally:
            os._exit(130 if name == "SIGINT" else 143)
    _Signals.received = name
    raise KeyboardInterrupt


def install_signal_handlers() -> None:
    """Ctrl-C and SIGTERM handled by qerl from now on (idempotent; nothing outside the main thread)."""
    if _Signals.installed:
        return
    try:
        _Signals.previous = {s: signal.signal(s, _on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    except ValueError:  # not the main thread: leave signals to whoever owns that
        return
    _Signals.installed = True
    _Signals.unraisable = sys.unraisablehook
    sys.unraisablehook = _unraisable


def _unraisable(info) -> None:
    """A Ctrl-C that landed in a finalizer or callback is "ignored" by Python (a traceback printed, the
    run going on): delivered again instead, to code that can stop."""
    if _Signals.running and issubclass(info.exc_type, KeyboardInterrupt):
        import _thread

        _thread.interrupt_main(signal.SIGINT)
        return
    _Signals.unraisable(info)


def restore_signal_handlers() -> None:
    if _Signals.installed:
        sys.unraisablehook = _Signals.unraisable
        for s, h in _Signals.previous.items():
            try:
                signal.signal(s, h if h is not None else signal.SIG_DFL)
            except ValueError:
                pass
        _Signals.installed, _Signals.running, _Signals.command = False, False, None


def _started_as_the_command() -> bool:
    """`qerl ...` (the installed script) or `python -m qerl ...`, not a program importing qerl.cli."""
    mp = sys.modules.get("multiprocessing")
    if mp is not None and mp.parent_process() is not None:  # a spawned worker: its parent handles Ctrl-C
        return False
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    return (getattr(spec, "name", None) == "qerl.__main__"
            or os.path.basename(sys.argv[0] if sys.argv else "").removesuffix(".exe") == "qerl")


def _begin_running() -> None:
    """run() may write from here on: Ctrl-C becomes a KeyboardInterrupt the command reports with what it
    kept, and SIGTERM goes back to its previous handling (`qerl train` and `qerl sft` install their own)."""
    _Signals.running = True
    if _Signals.installed:
        try:
            signal.signal(signal.SIGTERM, _Signals.previous.get(signal.SIGTERM) or signal.SIG_DFL)
        except ValueError:
            pass


def begin_running() -> None:
    """For entry points outside `qerl` (the recipes): qerl's Ctrl-C handling from here on, so a Ctrl-C a
    library turns into another error is still known (`interrupt_received`). Undo with restore_signal_handlers."""
    install_signal_handlers()
    _Signals.received = None
    _begin_running()


def interrupt_received() -> bool:
    """A Ctrl-C (or SIGTERM) reached the process since run() began, whatever error it surfaced as."""
    return _Signals.received is not None


def check_interrupted() -> None:
    """A Ctrl-C that reached the process after run() began but was swallowed on its way (a library's
    `except BaseException`, a finalizer): raised again before the work it should have stopped."""
    if _Signals.received:
        raise KeyboardInterrupt


def interrupted_line(command: str, signame: str = "SIGINT") -> str:
    """The line a command stopped by Ctrl-C before it wrote anything ends with: `qerl train`'s shape."""
    if command in ("train", "sft"):
        return (f"qerl {command}: stopped by {signame} before training started; no checkpoint saved yet; start again "
                f"with the same command (add --overwrite_output_dir if the folder holds its metrics)")
    what = {"export": "nothing written (the output folder is unchanged)",
            "quantize": "nothing written (the output folder is unchanged)",
            "eval": "no report written"}.get(command, "nothing written")
    return f"qerl{' ' + command if command else ''}: stopped by {signame}; {what}"


if _started_as_the_command():  # before any heavy import below or in the parser
    install_signal_handlers()

import argparse  # noqa: E402

from . import bench, evaluate, export, generate, inspect, plot, quantize, sft, study, train
from .examples import epilog
from .spelling import both_spellings
from .vocabulary import apply as trl_vocabulary

COMMANDS = {"inspect": inspect, "quantize": quantize, "export": export, "generate": generate, "bench": bench,
            "train": train, "sft": sft, "eval": evaluate, "plot": plot, "study": study}


def _is_number(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return False


def glue_negative_numbers(argv: list[str]) -> list[str]:
    """`--learning_rate -1e-3` as `--learning_rate=-1e-3`: argparse takes a negative number with an exponent
    for an option ("expected one argument"); glued to its flag, the value reaches the field's own check."""
    out: list[str] = []
    for t in argv:
        if out and t.startswith("-") and _is_number(t) and out[-1].startswith("--") and "=" not in out[-1]:
            out[-1] = f"{out[-1]}={t}"
        else:
            out.append(t)
    return out


def main(argv: list[str] | None = None) -> int:
    argv = glue_negative_numbers(list(sys.argv[1:] if argv is None else argv))
    command = _command_from(argv)
    owned = not _Signals.installed  # called from a program (or a test): its handlers come back at the end
    install_signal_handlers()
    _Signals.command, _Signals.received = command, None
    try:
        return _main(argv)
    except KeyboardInterrupt:  # `qerl train` and `qerl sft` say what was saved themselves, once training started
        return _interrupted(command)
    except SystemExit as e:  # SIGTERM inside a write (checkpoint/atomic.py): its temporary is removed by now
        atomic = sys.modules.get("qerl.checkpoint.atomic")  # loaded whenever it raised: no torch import here
        if atomic is None or not isinstance(e, atomic.Terminated):
            raise
        return _interrupted(command, e.signal_name, e.code)
    except Exception:
        if _Signals.received:  # a Ctrl-C a library turned into another error (pybind11's error_already_set)
            return _interrupted(command)
        raise
    finally:
        if owned:
            restore_signal_handlers()


def _interrupted(command: str, signame: str = "SIGINT", code: int = 130) -> int:
    """The one line of a command stopped by a signal (Ctrl-C: 130; SIGTERM: 143), as `qerl train`'s."""
    after_interrupt()
    print(interrupted_line(command, signame), file=sys.stderr, flush=True)
    return code


def after_interrupt() -> None:
    """Once a Ctrl-C is caught and reported: the process ends with status 130, as it says.

    - CPython kills itself with SIGINT at exit when a KeyboardInterrupt last left code run through
      PyRun_String (as pybind11's eval runs it, inside torch and transformers' start-up), even when
      the program caught it: exit status -2 instead of 130. One trivial PyRun_String resets that flag.
    - Cleanup (locks, worker processes) runs next; another Ctrl-C ends the process at once with 130
      instead of a traceback from inside that cleanup."""
    import signal

    try:
        import ctypes

        ctypes.pythonapi.PyRun_SimpleStringFlags(b"pass", None)
    except (ImportError, AttributeError, OSError):  # not CPython: nothing to reset
        pass
    try:
        signal.signal(signal.SIGINT, lambda *_: os._exit(130))
    except ValueError:  # not the main thread
        pass


def _main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="qerl", description="RL of LLMs on 4-bit weights (QeRL).")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, mod in COMMANDS.items():
        # train: no prefix matching, so a misspelt field reaches the config's "did you mean"
        p = sub.add_parser(name, help=mod.HELP, description=getattr(mod, "DESCRIPTION", mod.HELP),
                           usage=getattr(mod, "USAGE", None), epilog=epilog(name),
                           formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=name not in ("train", "sft"))
        mod.add_arguments(p)
        both_spellings(p, skip_dest_prefixes=("config__", "sft__"))  # --max_new_tokens and --max-new-tokens
        trl_vocabulary(name, p)  # TRL's names shown, one spelling each; the others are hidden aliases
    args, extra = parser.parse_known_args(argv)
    if extra:  # only `train` (and `study run`, for its runs) take free --field value pairs (any config field)
        if args.command in ("train", "sft"):
            args.overrides = extra
        elif args.command == "study":
            args.train_args = [a for a in extra if a != "--"]
        else:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
    _begin_running()
    try:
        return COMMANDS[args.command].run(args) or 0
    except Exception as e:
        if not said_in_one_line(e) or os.environ.get("QERL_DEBUG"):  # the traceback: a bug, or asked for
            raise
        print(f"qerl {args.command}: error: {e}", file=sys.stderr)
        return 2


def said_in_one_line(e: BaseException) -> bool:
    """Errors whose message says what went wrong and what to do (bad input, a missing file, a run that
    stopped on a non-finite loss and names its last good checkpoint); anything else is a bug and keeps
    its traceback."""
    if isinstance(e, (ValueError, OSError, KeyError, ModuleNotFoundError)):
        return True
    optim = sys.modules.get("qerl.train.optim")  # loaded whenever it raised: no torch import here
    return optim is not None and isinstance(e, optim.TrainingError)


if __name__ == "__main__":
    sys.exit(main())
