"""A run that stops before its end, `qerl train` and `qerl sft` alike: Ctrl-C or SIGTERM, or a write the
disk refused, said in one line: where it stopped, what is saved, the exact command that continues it."""

from __future__ import annotations

import contextlib
import shlex
import signal


class _Stop:
    signal = "SIGINT"


@contextlib.contextmanager
def interruptible():
    """SIGTERM ends the run the way Ctrl-C does (a KeyboardInterrupt the caller turns into one line)."""
    stop = _Stop()

    def on_term(signum, frame):
        stop.signal = "SIGTERM"
        raise KeyboardInterrupt

    try:
        old = signal.signal(signal.SIGTERM, on_term)
        if hasattr(signal, "SIGXFSZ"):  # past `ulimit -f`: a write fails with EFBIG, said in one line, not a kill
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    except ValueError:  # not the main thread: leave SIGTERM alone
        old = None
    try:
        yield stop
    finally:
        if old is not None:
            signal.signal(signal.SIGTERM, old)


def resume_command(cfg, command: str = "train") -> str:
    from ..invocation import qerl_command

    return f"{qerl_command()} {command} --resume {shlex.quote(str(cfg.output_dir))}"


def saved(output_dir) -> str:
    from ..train.checkpoints import checkpoints

    found = checkpoints(output_dir)
    return f"saved: {found[-1]}" if found else "no checkpoint saved yet"


def interrupted(cfg, trainer, signame: str, command: str = "train") -> str:
    """One line: where the run stopped, what is on disk, the exact command that continues it."""
    from ..train.checkpoints import checkpoints

    total = getattr(trainer, "max_steps", None) or cfg.max_steps
    where = f"at step {trainer.step}/{total}" if trainer is not None else "before training started"
    if checkpoints(cfg.output_dir):
        then = f"continue with: {resume_command(cfg, command)}"
    else:
        then = "start again with the same command (add --overwrite_output_dir if the folder holds its metrics)"
    return f"qerl {command}: stopped by {signame} {where}; {saved(cfg.output_dir)}; {then}"


def write_refused(e: BaseException, cfg, command: str = "train") -> OSError | None:
    """A write the disk refused (full, or a file past `ulimit -f`) as one line: the folder, what is kept,
    how to go on; None for any other error."""
    from ..checkpoint.disk import refusal_text, refused_write
    from ..train.checkpoints import checkpoints

    code = refused_write(e)
    if code is None:
        return None
    what, fix = refusal_text(code, cfg.output_dir)
    then = (f"continue with: {resume_command(cfg, command)}" if checkpoints(cfg.output_dir) else
            "start again with the same command (add --overwrite_output_dir if the folder holds its metrics)")
    out = OSError(f"{what} ({type(e).__name__}); {saved(cfg.output_dir)}; {fix}, then {then}")
    out.errno = code
    return out
