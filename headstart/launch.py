"""How a verb's processes start, meet and end: the launch checks every multi-process verb makes, a
rendezvous that names the ranks that never came, and signal handling so that SIGTERM or Ctrl-C ends
a verb even when it is blocked inside a collective or a store (only SIGKILL used to).

Ranks come from a launcher: torchrun (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT), SLURM through
torchrun, a hand-set environment (RANK, WORLD_SIZE, MASTER_ADDR/PORT), or Lightning's own spawner for
`trainer.devices > 1` under DDP (LOCAL_RANK, WORLD_SIZE). A WORLD_SIZE that no launcher set is refused.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import sys
import threading
import time
from typing import Any, NoReturn

from headstart.console import status
from headstart.errors import ConfigError, HeadstartError

RENDEZVOUS_TIMEOUT_S = 300.0  # default wait for every rank; HEADSTART_RENDEZVOUS_TIMEOUT_S overrides it
TERM_GRACE_S = 15.0  # after SIGTERM / Ctrl-C, how long a blocked verb has to stop before it is ended
_STORE: Any = None  # rank 0's store server: kept alive for the process group that forms on the same port
_WAKE: Any = None  # the signal wakeup socket: open as long as the process runs (closing it ends the watchdog)


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread like Ctrl-C's KeyboardInterrupt (cleanups run on both)."""


MAX_SECONDS = 1e8  # ~3 years: any longer wait is a typo (and overflows a timedelta near 1e14)


def _seconds(name: str, default: float) -> float:
    text = os.environ.get(name)
    if text is None:
        return default
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not (0 < value <= MAX_SECONDS):  # nan fails too
        raise ConfigError(f"{name}={text[:40]!r}: expected a positive number of seconds (at most {MAX_SECONDS:.0e})")
    return value


def torchrun_line(verb: str, recipe: str, overrides: list[str], flags: list[str], nproc: int, nnodes: int = 1) -> str:
    """The command that launches `verb` on nproc x nnodes ranks."""
    nodes = ["--nnodes", str(nnodes), "--rdzv-backend", "c10d", "--rdzv-endpoint", "HOST:29500"] if nnodes > 1 else []
    args = [recipe, *[a for o in overrides for a in ("--set", o)], *flags]
    return shlex.join(["torchrun", *nodes, "--nproc-per-node", str(nproc), "-m", "headstart.cli", verb, *args])


def launch_env() -> tuple[int, int]:
    """(WORLD_SIZE, RANK) of this process's launch, checked: whole numbers, RANK below WORLD_SIZE, LOCAL_RANK
    a whole number too; unset: one process, rank 0. A bad value is named here, before any verb works,
    not met later as a ValueError in an import, a gloo RuntimeError or a rendezvous that waits for a rank
    that cannot exist."""
    env = os.environ

    def whole(name: str, default: int) -> int:
        text = env.get(name)
        if text is None or not text.strip() or (name == "LOCAL_RANK" and text.strip() == "-1"):  # unset, as before
            return default
        if not (text.strip().isascii() and text.strip().isdigit()):
            raise ConfigError(f"{name}={text[:20]!r} in the environment: expected a whole number >= 0 (torchrun "
                              "sets it; unset it to run one process)")
        return int(text)

    world, rank = whole("WORLD_SIZE", 1), whole("RANK", 0)
    whole("LOCAL_RANK", 0)
    if rank >= max(world, 1):
        raise ConfigError(f"RANK={rank} in the environment, but WORLD_SIZE={env.get('WORLD_SIZE', '(unset: 1)')}: "
                          f"ranks are numbered 0..WORLD_SIZE-1; launch with torchrun, which sets both, or unset them")
    return world, rank


def check_world_size(verb: str, line: str | None = None) -> None:
    """WORLD_SIZE > 1 in the environment says several ranks, but only a launcher starts them: without
    one (no RANK / LOCAL_RANK / SLURM_PROCID) this process would run alone, or wait for ranks that
    never start. `line`: the launch command to suggest."""
    launch_env()
    env = os.environ
    world = env.get("WORLD_SIZE")
    if world is None or world.strip() in ("", "1", "0"):
        return
    if any(k in env for k in ("RANK", "LOCAL_RANK", "SLURM_PROCID")):
        return
    how = line or f"torchrun --nproc-per-node {world[:8]} -m headstart.cli {verb} ..."
    raise ConfigError(f"WORLD_SIZE={world[:8]} is set in the environment, but no launcher started this process (no "
                      f"RANK or LOCAL_RANK, which torchrun sets), so {verb} would run as one process, not "
                      f"{world[:8]}: launch the ranks with `{how}`, or unset WORLD_SIZE to run one process")


def check_train_launch(trainer: Any, line: str) -> None:
    """train's ranks: trainer.devices x trainer.num_nodes processes. Lightning spawns the local ranks
    itself for DDP; FSDP (ModelParallelStrategy) and several nodes need torchrun, which is refused
    here with its command line instead of deadlocking once the spawned ranks start."""
    check_world_size("train")
    world = trainer.devices * trainer.num_nodes
    env = os.environ
    launched = any(k in env for k in ("RANK", "LOCAL_RANK", "SLURM_PROCID"))
    if world == 1 or launched:
        return
    if trainer.strategy == "fsdp":
        raise ConfigError(f"trainer.strategy fsdp with trainer.devices x trainer.num_nodes = {world} ranks: FSDP ranks "
                          f"are started by torchrun, not by train itself; launch `{line}`")
    if trainer.num_nodes > 1:
        raise ConfigError(f"trainer.num_nodes {trainer.num_nodes}: the ranks of several nodes are started by torchrun "
                          f"on each node; launch `{line}`")


def rendezvous(timeout_s: float | None = None) -> None:
    """Every rank of a hand-set or torchrun launch (RANK, WORLD_SIZE, MASTER_ADDR/PORT) announces itself
    in the launch's store and waits, at most HEADSTART_RENDEZVOUS_TIMEOUT_S (default 300 s), for all the
    others; a rank that never comes is named instead of a silent wait (torch's own is 30 minutes)."""
    global _STORE
    import datetime

    import torch.distributed as dist

    env = os.environ
    world, rank = launch_env()
    if world <= 1:
        return
    timeout = _seconds("HEADSTART_RENDEZVOUS_TIMEOUT_S", RENDEZVOUS_TIMEOUT_S) if timeout_s is None else timeout_s
    addr, port = env.get("MASTER_ADDR"), env.get("MASTER_PORT")
    if not addr or not (port or "").isdigit():
        raise ConfigError(f"WORLD_SIZE={world}, RANK={rank}, but MASTER_ADDR / MASTER_PORT are not set (or not a "
                          "port): they say where the ranks meet; launch with torchrun, which sets them")
    where = f"{addr}:{port}"
    host = rank == 0 and env.get("TORCHELASTIC_USE_AGENT_STORE") != "True"  # torchrun's agent hosts its own
    if not host:
        status(f"rendezvous: rank {rank} of {world} joining {where} (waiting up to {timeout:g}s)")
    try:
        store = dist.TCPStore(addr, int(port), world, is_master=host, timeout=datetime.timedelta(seconds=timeout),
                              wait_for_workers=False, multi_tenant=True)
    except (RuntimeError, OSError) as e:  # DistNetworkError / DistStoreError: torch's RuntimeErrors
        cause = str(e).strip().splitlines()[0][:120] if str(e).strip() else type(e).__name__
        if host:
            raise HeadstartError(f"rendezvous: rank 0 cannot listen on {where} ({cause}); choose a free MASTER_PORT") \
                from None
        raise HeadstartError(f"rendezvous: rank {rank} of {world} found no rank 0 at {where} within {timeout:g}s "
                             f"({cause}); start every rank (RANK 0..{world - 1}) with the same MASTER_ADDR / "
                             "MASTER_PORT, e.g. with torchrun, or raise HEADSTART_RENDEZVOUS_TIMEOUT_S") from None
    if host:
        _STORE = store
    prefix = f"headstart/rendezvous/{env.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
    start, told = time.monotonic(), False
    try:
        store.set(f"{prefix}{rank}", "1")
        while True:
            missing = [r for r in range(world) if not store.check([f"{prefix}{r}"])]
            waited = time.monotonic() - start
            if not missing:
                return
            if waited >= timeout:
                break
            if not told and waited >= min(10.0, timeout / 2):
                status(f"rendezvous: rank {rank} waiting at {where} for rank(s) {_ranks(missing)} of {world}")
                told = True
            time.sleep(0.2)
    except (RuntimeError, OSError) as e:
        raise HeadstartError(f"rendezvous: the store at {where} went away while rank {rank} of {world} waited "
                             f"({str(e).strip()[:120]}); rank 0 has probably stopped") from None
    came = world - len(missing)
    raise HeadstartError(f"rendezvous: {came} of WORLD_SIZE={world} ranks came to {where} within {timeout:g}s; "
                         f"rank(s) {_ranks(missing)} never came. Start all {world} ranks (torchrun "
                         f"--nproc-per-node {world} -m headstart.cli ...), or raise HEADSTART_RENDEZVOUS_TIMEOUT_S")


def launched_ranks() -> int:
    """How many ranks the launch of this process started (WORLD_SIZE, which torchrun, a hand-set
    launch and Lightning's spawner all set; 1 when unset or not a number)."""
    text = os.environ.get("WORLD_SIZE", "1").strip()
    return int(text) if text.isascii() and text.isdigit() else 1


def end_rank(code: int) -> NoReturn:
    """End this rank of a multi-process run with `code`: the exit handlers run (atexit: loggers, wandb)
    and the standard streams are flushed, but the interpreter's teardown is skipped. A process-group
    thread (gloo's, freeing the last collective's tensors) that takes the GIL once the teardown has
    begun is ended inside a C++ destructor, which aborts the process (SIGABRT, "terminate called without
    an active exception") after the work is done, and torchrun then reports the whole run failed;
    destroy_process_group does not stop those threads while anything still holds the group."""
    import atexit

    with contextlib.suppress(SystemExit):
        sys.exit(code)  # a library's sys.exit hook (wandb's) records the code its exit handler reports
    threading._shutdown()  # the teardown's first step: non-daemon threads finish, executors' queued work runs
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def _ranks(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks[:16])) + (f" (+{len(ranks) - 16} more)" if len(ranks) > 16 else "")


def install_signal_handlers() -> None:
    """SIGTERM raises Terminated in the main thread (as Ctrl-C raises KeyboardInterrupt), and a watchdog
    process ends this one if it is still running HEADSTART_TERM_GRACE_S (default 15 s) after either: a
    rank blocked inside a collective or a store never returns to Python (and may hold the GIL), so
    neither exception could stop it, and no thread of its own could either.
    For the command line only (`headstart` / `python -m headstart.cli`), not for a library caller."""
    import select
    import socket

    if threading.current_thread() is not threading.main_thread():
        return
    grace = _seconds("HEADSTART_TERM_GRACE_S", TERM_GRACE_S)

    def on_sigterm(signum: int, frame: Any) -> None:
        raise Terminated()

    # The interpreter's C-level handler writes each handled signal's number into wake_w, whatever the
    # main thread is doing; the watchdog (a grandchild, so no zombie is left) reads it from wake_r.
    wake_r, wake_w = socket.socketpair()
    parent = os.getpid()
    child = os.fork()
    if child == 0:
        try:
            if os.fork() == 0:
                _watch(wake_r, wake_w, parent, grace, select)
        finally:
            os._exit(0)
    global _WAKE
    os.waitpid(child, 0)
    wake_r.close()
    _WAKE = wake_w
    wake_w.setblocking(False)
    signal.signal(signal.SIGTERM, on_sigterm)
    signal.set_wakeup_fd(wake_w.fileno(), warn_on_full_buffer=False)


def _watch(wake_r: Any, wake_w: Any, parent: int, grace: float, select: Any) -> None:
    """The watchdog's loop: the first SIGTERM / SIGINT starts the grace period; the parent's exit (the
    socket's end of file) ends the watchdog."""
    wake_w.close()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)
    os.dup2(devnull, 1)  # a reader of the verb's stdout sees its end when the verb ends
    while data := wake_r.recv(1):
        if data[0] not in (signal.SIGTERM, signal.SIGINT):
            continue
        end = time.monotonic() + grace
        while (left := end - time.monotonic()) > 0:
            if select.select([wake_r], [], [], left)[0] and not wake_r.recv(64):
                return  # the verb ended within the grace period
        name = signal.Signals(data[0]).name
        print(f"headstart: still running {grace:g}s after {name} (blocked in a collective, a rendezvous or "
              "I/O); ending it now", file=sys.stderr, flush=True)
        with contextlib.suppress(ProcessLookupError):
            os.kill(parent, signal.SIGKILL)
        return
