"""A fork server ("zygote") for the tests' ``python -m monai.bundle`` runs: one long-lived process that has imported
torch and MONAI once, and forks a child per run. A ``python -m monai.bundle`` process spends ~6 s importing torch and
MONAI before it reads its config, and the workflow tests start dozens of them; a child of the zygote starts at once.

Each child is still a process of its own, set up as ``python -m monai.bundle <argv>`` run from ``cwd`` with ``env``
would be: its working directory, environment (``os.environ`` and the C library's), ``sys.path`` (``cwd`` first, then
``PYTHONPATH``'s entries, then the interpreter's own; not this folder), ``sys.argv``, a fresh temporary folder
setting, fds 0-2 and ``sys.stdout``/``sys.stderr`` on files of its own, the CPUs it may run on, reseeded random
number generators; then ``runpy`` runs ``monai.bundle`` as ``__main__``, and it ends as the interpreter ends a process
(SystemExit's status, an uncaught exception's traceback and status 1, non-daemon threads joined, ``atexit`` handlers
run). What the imports wrote to stdout and stderr (a warning of holoscan's, imported by ``import monai``) is written
at the start of each child's, as each process of its own writes it. The zygote reports each child's exit status as
``subprocess`` does (``-9`` for a run killed by SIGKILL).

The zygote imports only what every ``python -m monai.bundle`` process imports (torch, monai, monai.bundle): a run's
own modules (the bundle's ``scripts``, highdicom, OpenVINO, ...) are imported by the run, so the modules a run
imports are those of a process of its own. It starts no thread and runs no torch op (OpenMP's thread pool would not
survive a fork); the threads its imports start are OpenBLAS's servers (numpy's, scipy's, OpenCV's), which OpenBLAS
stops and restarts around a fork, as every run's DataLoader workers already rely on. Settings that the interpreter,
OpenMP, BLAS or torch read as they start (:data:`IMPORT_TIME_ENV`) are the zygote's: a run whose environment sets
them otherwise gets a zygote of its own (at most :data:`MAX_ZYGOTES`), else a process of its own (with a warning,
once). The variables that the imports themselves set
(OpenCV's LD_LIBRARY_PATH and QT_*, scikit-learn's KMP_*, MONAI's CUBLAS_WORKSPACE_CONFIG, GDCM's resources) are set
in each child's environment as the imports would have set them in a process of its own.

Not only ``python -m monai.bundle``: a run is any ``python ARGS`` whose ARGS are ``-m MODULE ...``, ``-c CODE ...``
or ``SCRIPT ...`` (:func:`run_python`, :func:`start_python`); ``sys.path``, ``sys.argv`` and ``__main__`` are set as
the interpreter sets them for each form. The imports' output is written first only for ``-m monai.bundle``, the run
whose own imports would write it (a ``-c`` or a script may never import MONAI).

Protocol, one JSON line each way: a request ``{"id", "args", "cwd", "env", "stdout", "stderr", "cpus",
"new_session"}`` is answered ``{"id", "pid"}`` once forked and ``{"id", "returncode"}`` once ended (runs overlap: the
zygote waits on pidfds); ``{"kill": id, "group": bool}`` sends the run (or its session's process group) SIGKILL (the
zygote, its parent, kills only while it has not reaped it, so never a reused pid). Run as a script (``python zygote.py
FOLDER``) this module is the zygote; imported, :func:`run` is its client, with a zygote per process and set of
start-up settings, started on first use and ended when the process ends.

Processes the tests do not start themselves (the folds that ``scripts.cross_validation`` starts, MONAI Label's training
process, torchrun's ranks by :func:`through`, a SLURM job's ``python`` and ``torchrun`` by :func:`shims`) reach the
zygote through a Unix socket, ``FOLDER/zygote.sock`` (:func:`launcher`): ``python zygote.py --exec
ARGS`` sends its ARGS, working directory, environment, CPUs and fds 0-2 (SCM_RIGHTS), the zygote forks the run on
those fds in a session of its own and answers its pid, then its exit status; the client passes on the signals a
launcher receives (TERM, INT, HUP, USR1, USR2) and ends as the run ended. A client that dies (``kill -9`` of the
process group it is in) takes its run's session with it: the zygote sees its connection close and kills the session.
Where the zygote refuses (a setting read at start-up differs) or cannot be reached, the client ``exec``s ``python
ARGS`` itself.
"""

from __future__ import annotations

import atexit
import builtins
import contextlib
import importlib
import importlib.util
import itertools
import json
import os
import runpy
import select
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import traceback
import types
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple, NoReturn

#: the modules every ``python -m monai.bundle`` process imports, imported once by the zygote
PRELOADED = ("torch", "monai", "monai.bundle")
#: prefixes of the environment variables read when the interpreter, OpenMP, BLAS, torch or MONAI start (PYTHONPATH
#: aside: each child sets ``sys.path`` from its own). Not TORCHINDUCTOR_/TORCHDYNAMO_: their configs are read when a
#: run first compiles (the bundle's compile cache sets TORCHINDUCTOR_CACHE_DIR in the tests' own process)
IMPORT_TIME_ENV = ("PYTHON", "OMP_", "GOMP_", "KMP_", "MKL_", "OPENBLAS_", "GOTO", "LD_", "LANG", "LC_", "TORCH_",
                   "PYTORCH_", "MONAI_", "CUDA_", "NUMEXPR_")  # fmt: skip
#: prefixes among those of the variables read later: MONAI Label's (as monailabel is imported, which the zygote does
#: not import) and NCCL's process group's (as one is made; torchrun sets TORCH_NCCL_ASYNC_ERROR_HANDLING)
NOT_AT_IMPORT = ("MONAI_LABEL_", "TORCH_NCCL_")
#: variables read as a GPU runtime starts, never in a zygote whose torch has no GPU build (SLURM sets
#: CUDA_VISIBLE_DEVICES for the GPUs a job asked for)
GPU_ENV = ("CUDA_", "HIP_", "ROCR_")
#: ``BUNDLE_RUN_SUBPROCESS=1`` in the tests' environment: every run a process of its own (to check the zygote changes
#: nothing)
SUBPROCESS = "BUNDLE_RUN_SUBPROCESS"
#: how long a killed run or an ending zygote is waited for
GRACE_S = 60
#: the zygote's socket, in its folder: a request per connection (a JSON line, fds 0-2 with its first bytes)
SOCKET_NAME = "zygote.sock"
#: the variable that names the socket to a client (``python zygote.py --exec``)
SOCKET_ENV = "TESTS_ZYGOTE_SOCKET"
#: the signals a client passes on to its run, as a launcher does
PASSED_ON = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)
#: the bundle's command, as ``python`` takes it
BUNDLE = ("-m", "monai.bundle")
#: this file: the zygote (``python zygote.py FOLDER``), and its socket's client (``python zygote.py --exec ARGS``)
SCRIPT = str(Path(__file__).resolve())
# where the zygote's folders go: the temporary folder as this module was imported, before any test set TMPDIR
_TMP = Path(tempfile.gettempdir())


class ZygoteError(RuntimeError):
    """The zygote could not start, or ended; ``forked``: whether the run asked for had already started."""

    def __init__(self, message: str, forked: bool = False) -> None:
        super().__init__(message)
        self.forked = forked


def import_settings(env: Mapping[str, str]) -> dict[str, str]:
    """The variables of ``env`` that take effect as a process starts (a zygote's are those it started with)."""
    return {k: v for k, v in env.items()
            if k.startswith(IMPORT_TIME_ENV) and k != "PYTHONPATH" and not k.startswith(NOT_AT_IMPORT)}  # fmt: skip


def python_form(args: Sequence[str]) -> tuple[str, str, list[str]] | None:
    """``python ARGS`` as the zygote runs it: ``("module" | "code" | "path", target, argv after it)``, or None for a
    form it does not run (interpreter options such as ``-u`` or ``-X``: a process of its own)."""
    args = list(args)
    if len(args) >= 2 and args[0] in ("-m", "-c"):
        return ("module" if args[0] == "-m" else "code"), args[1], args[2:]
    if args and not args[0].startswith("-"):
        return "path", args[0], args[1:]
    return None


def differing_settings(
    zygote: Mapping[str, str], run: Mapping[str, str], imports: Mapping[str, list], unread: Sequence[str] = ()
) -> list[str]:
    """The import-time variables that ``run``'s environment sets otherwise than ``zygote``'s (the environment the
    zygote started with), but a variable that the zygote's imports set (``imports``: name: [before, after]) and that
    ``run`` has as it was before them or as they left it: a process that imported them (the tests' own, once a test
    imported MONAI: OpenCV's LD_LIBRARY_PATH, scikit-learn's KMP_* settings) passes on what its own imports set; and
    none with a prefix of ``unread`` (the zygote's :data:`GPU_ENV` where its torch has no GPU build)."""
    ours, theirs = import_settings(zygote), import_settings(run)
    names = {k for k in {*ours, *theirs} if ours.get(k) != theirs.get(k) and not k.startswith(tuple(unread))}
    return sorted(k for k in names if k not in imports or theirs.get(k) not in imports[k])


class _Run:
    """One run asked of the zygote: its output files, and the child's pid and exit status as they are answered."""

    def __init__(self, run_id: int, folder: Path) -> None:
        self.id = run_id
        self.stdout, self.stderr = folder / f"{run_id}.out", folder / f"{run_id}.err"
        self.pid: int | None = None
        self.returncode: int | None = None
        self.error: str | None = None
        self.ended = threading.Event()

    def output(self, binary: bool = False) -> tuple[Any, Any]:
        """What the run wrote to stdout and stderr so far: text as ``subprocess``'s ``text=True`` decodes it (the
        locale's encoding, universal newlines), or bytes."""
        texts = []
        for path in (self.stdout, self.stderr):
            try:
                texts.append(path.read_bytes() if binary else path.read_text())
            except FileNotFoundError:
                texts.append(b"" if binary else "")
        return texts[0], texts[1]

    def remove(self) -> None:
        for path in (self.stdout, self.stderr):
            path.unlink(missing_ok=True)


class Zygote:
    """The client of one zygote process: starts it with ``env``, asks it for runs, and gives each caller its run's
    answers (a thread reads them, so runs from several threads overlap)."""

    def __init__(self, env: Mapping[str, str]) -> None:
        self.folder = Path(tempfile.mkdtemp(prefix="zygote-", dir=_TMP))
        self.env = {k: v for k, v in env.items() if k != "PYTHONPATH"}
        self._lock = threading.Lock()  # the request pipe, and the table of runs
        self._runs: dict[int, _Run] = {}
        self._ids = itertools.count()
        with (self.folder / "zygote.log").open("wb") as log:
            command = [sys.executable, SCRIPT, str(self.folder)]
            pipe = subprocess.PIPE
            self.process = subprocess.Popen(command, stdin=pipe, stdout=pipe, stderr=log, cwd=self.folder, env=self.env)
        line = self.process.stdout.readline()  # the zygote's imports: as long as a run's
        self.ready = json.loads(line) if line.strip() else {}
        if not self.ready.get("ready"):
            why = self.log()
            self.close()
            raise ZygoteError(f"the zygote did not start: {why}")
        self.alive = True
        threading.Thread(target=self._read_answers, name="zygote answers", daemon=True).start()

    def log(self) -> str:
        """The end of what the zygote itself wrote (its errors)."""
        try:
            return (self.folder / "zygote.log").read_text(errors="replace")[-3000:]
        except OSError:
            return "(no log)"

    def _read_answers(self) -> None:
        try:
            for line in self.process.stdout:
                answer = json.loads(line)
                with self._lock:
                    run = self._runs.get(answer["id"])
                    if run is None:
                        continue
                    if "pid" in answer:
                        run.pid = answer["pid"]
                        continue
                    run.returncode, run.error = answer.get("returncode"), answer.get("error")
                    del self._runs[run.id]
                run.ended.set()
        finally:
            self._ended()

    def _ended(self) -> None:
        with self._lock:  # the zygote ended: no run still asked of it will be answered
            self.alive = False
            ended, self._runs = list(self._runs.values()), {}
        for run in ended:
            run.ended.set()

    def _send(self, request: dict) -> None:
        self.process.stdin.write(json.dumps(request).encode() + b"\n")
        self.process.stdin.flush()

    def start(self, args: Sequence[str], cwd: Path, env: Mapping[str, str], new_session: bool = False) -> _Run:
        """Ask for the run of ``python *args`` (in a session of its own with ``new_session``); it runs while the caller
        waits on its ``ended``."""
        with self._lock:
            if not self.alive:
                raise ZygoteError(f"the zygote has ended: {self.log()}")
            run = _Run(next(self._ids), self.folder)
            self._runs[run.id] = run
            request = {"id": run.id, "args": list(args), "cwd": str(cwd), "env": dict(env), "stdout": str(run.stdout),
                       "stderr": str(run.stderr), "cpus": sorted(os.sched_getaffinity(0)),
                       "new_session": new_session}  # fmt: skip
            try:
                self._send(request)
            except OSError as error:
                self.alive = False
                del self._runs[run.id]
                raise ZygoteError(f"the zygote has ended ({error}): {self.log()}") from error
        return run

    def kill(self, run: _Run, group: bool = False) -> None:
        """SIGKILL to ``run`` (``group``: to its session's process group) if it still runs."""
        with self._lock, contextlib.suppress(OSError):
            self._send({"kill": run.id, "group": group})

    def run(
        self, args: Sequence[str], cwd: Path, env: Mapping[str, str], timeout: float | None = None
    ) -> subprocess.CompletedProcess:
        """``subprocess.run([python, *args], cwd=cwd, env=env, capture_output=True, text=True,
        timeout=timeout)``, forked from the zygote."""
        command = [sys.executable, *args]
        if not Path(cwd).is_dir():  # where subprocess raises too: before anything runs
            raise FileNotFoundError(f"no such directory: {cwd}")
        run = self.start(args, cwd, env)
        try:
            if not run.ended.wait(timeout):
                self.kill(run)
                run.ended.wait(GRACE_S)
                stdout, stderr = run.output(binary=True)
                raise subprocess.TimeoutExpired(command, timeout, output=stdout or None, stderr=stderr or None)
            if run.error is not None:
                raise OSError(f"the zygote could not start the run: {run.error}")
            if run.returncode is None:
                raise ZygoteError(f"the zygote ended while the run {command} ran: {self.log()}", run.pid is not None)
            stdout, stderr = run.output()
            return subprocess.CompletedProcess(command, run.returncode, stdout, stderr)
        except BaseException:  # as subprocess.run: a run interrupted (a timeout, Ctrl-C) is killed
            self.kill(run)
            raise
        finally:
            run.remove()

    def close(self) -> None:
        """End the zygote (it ends as its requests end) and remove its folder."""
        with contextlib.suppress(OSError):
            self.process.stdin.close()
        try:
            self.process.wait(GRACE_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        shutil.rmtree(self.folder, ignore_errors=True)


_ZYGOTES: list[Zygote] = []  # this process's zygotes, one per set of import-time settings
#: the most zygotes a process starts (each holds torch and MONAI imported, ~0.7 GB); beyond it, processes of their own
MAX_ZYGOTES = 2
_STARTING = threading.Lock()
_FAILED_STARTS: list[str] = []  # why each start failed; after two, runs are processes of their own
_MISMATCHES: list[list[str]] = []  # the import-time variables that sent runs to processes of their own


def _zygote(env: Mapping[str, str]) -> Zygote | None:
    """This process's zygote for a run with ``env``: the one whose import-time settings are ``env``'s, started on first
    use (again if it ended; a second one for other settings, such as torchrun's ranks' OMP_NUM_THREADS=1); None where
    none serves ``env`` (:data:`MAX_ZYGOTES` serve other settings, a zygote failed to start twice, or
    ``BUNDLE_RUN_SUBPROCESS=1`` asks for processes of their own)."""
    if os.environ.get(SUBPROCESS) == "1":
        return None
    with _STARTING:
        for ended in [z for z in _ZYGOTES if not z.alive]:
            ended.close()
            _ZYGOTES.remove(ended)
        for zygote in _ZYGOTES:
            if not differing_settings(zygote.env, env, zygote.ready["imports_env"], zygote.ready["unread"]):
                return zygote
        if len(_ZYGOTES) < MAX_ZYGOTES and len(_FAILED_STARTS) < 2:
            try:
                _ZYGOTES.append(Zygote(env))
                return _ZYGOTES[-1]
            except (OSError, ZygoteError) as error:
                _FAILED_STARTS.append(str(error))
                warnings.warn(f"bundle runs as processes of their own: {error}", RuntimeWarning, stacklevel=3)
                return None
        if _ZYGOTES:
            first = _ZYGOTES[0]
            names = differing_settings(first.env, env, first.ready["imports_env"], first.ready["unread"])
            if names not in _MISMATCHES:  # said once: every such run pays the imports again
                _MISMATCHES.append(names)
                message = f"bundle runs whose environment sets {', '.join(names)} otherwise than the zygotes'"
                warnings.warn(f"{message} run as processes of their own", RuntimeWarning, stacklevel=3)
        return None


def run(
    argv: Sequence[str], cwd: Path, env: Mapping[str, str], timeout: float | None = None
) -> subprocess.CompletedProcess:
    """``python -m monai.bundle *argv`` (see :func:`run_python`)."""
    return run_python([*BUNDLE, *argv], cwd, env, timeout)


def run_python(
    args: Sequence[str], cwd: Path, env: Mapping[str, str] | None = None, timeout: float | None = None
) -> subprocess.CompletedProcess:
    """``python *args`` from ``cwd`` with ``env`` (default: this process's), its output captured as text, as
    ``subprocess.run`` gives it: forked from this process's zygote, or a process of its own where no zygote serves
    (see :func:`_zygote`; a zygote that ended before the run started; a form :func:`python_form` does not take)."""
    env = dict(os.environ) if env is None else env
    zygote = _zygote(env) if python_form(args) else None
    if zygote is not None:
        try:
            return zygote.run(args, cwd, env, timeout)
        except ZygoteError as error:
            if error.forked:
                raise
    command = [sys.executable, *args]
    return subprocess.run(command, cwd=cwd, env=dict(env), capture_output=True, text=True, timeout=timeout)


def through(args: Sequence[str], env: Mapping[str, str]) -> tuple[list[str], dict[str, str]]:
    """``python ARGS`` as a launcher that starts ``python -u SCRIPT ...`` (torchrun) runs it forked from the zygote that
    serves ``env`` (the environment the launcher gives the processes it starts): the script and arguments to give it
    in place of ARGS (``zygote.py --exec ARGS``) and the variable to add to the launcher's environment; ARGS and no
    variable where no zygote serves ``env``."""
    launch = launcher(env)
    if launch is None:
        return list(args), {}
    return [SCRIPT, "--exec", *args], launch[1]


def shims(folder: Path, env: Mapping[str, str]) -> dict[str, str]:
    """``python`` and ``torchrun`` commands in ``folder`` for a script a test runs unchanged (the SLURM launchers):
    each starts what ``python`` or ``torchrun`` would, but every ``python`` process forked from the zygote that serves
    ``env`` (the environment the script runs in), torchrun's ranks too. Returns the variables to give the script
    (``PATH`` with ``folder`` first, the socket); none where no zygote serves ``env``."""
    launch = launcher(env)
    if launch is None:
        return {}
    command, variables = launch
    folder.mkdir(parents=True, exist_ok=True)
    scripts = {"python": f'#!/bin/sh\nexec {shlex.join(command)} "$@"\n',
               "torchrun": f'#!/bin/sh\nexec {shlex.join([sys.executable, SCRIPT])} --torchrun "$@"\n'}  # fmt: skip
    for name, text in scripts.items():
        (folder / name).write_text(text)
        (folder / name).chmod(0o755)
    return {**variables, "PATH": os.pathsep.join([str(folder), env.get("PATH", os.defpath)])}


def torchrun_args(args: Sequence[str]) -> list[str]:
    """torchrun's arguments with its ``-m MODULE`` script run as ``zygote.py --exec -m MODULE`` (any other form, as
    given)."""
    args = list(args)
    for k, arg in enumerate(args):
        if arg in ("-m", "--module"):
            return [*args[:k], SCRIPT, "--exec", "-m", *args[k + 1 :]]
        if arg == "--no-python":
            break
    return args


def launcher(env: Mapping[str, str] | None = None) -> tuple[list[str], dict[str, str]] | None:
    """What starts ``python ARGS`` from the zygote in a process the tests do not start themselves: the command to
    put before ARGS (``python zygote.py --exec``) and the variable to add to that process's environment; None where
    no zygote serves ``env`` (then ``python`` itself starts them)."""
    zygote = _zygote(dict(os.environ) if env is None else env)
    if zygote is None:
        return None
    return [sys.executable, SCRIPT, "--exec"], {SOCKET_ENV: str(zygote.folder / SOCKET_NAME)}


class Started:
    """A ``python *args`` run left running (a server a test talks to, stops or kills): forked from the zygote, or a
    process of its own where none serves; either way ``poll``, ``signal``, ``wait`` and ``output`` as a
    ``subprocess.Popen`` whose stdout and stderr go to files. ``new_session``: in a session of its own (as Popen's
    ``start_new_session``), whose process group :meth:`kill_group` kills."""

    def __init__(self, args: Sequence[str], cwd: Path, env: Mapping[str, str], new_session: bool = False) -> None:
        self.zygote, self.run, self.process = _zygote(env) if python_form(args) else None, None, None
        self.new_session = new_session
        if self.zygote is not None:
            with contextlib.suppress(ZygoteError):
                self.run = self.zygote.start(args, cwd, env, new_session)
        if self.run is None:
            self.folder = Path(tempfile.mkdtemp(prefix="started-", dir=_TMP))
            with (self.folder / "out").open("wb") as out, (self.folder / "err").open("wb") as err:
                self.process = subprocess.Popen([sys.executable, *args], cwd=cwd, env=dict(env), stdout=out,
                                                stderr=err, start_new_session=new_session)  # fmt: skip

    @property
    def pid(self) -> int | None:
        return self.run.pid if self.run is not None else self.process.pid

    def poll(self) -> int | None:
        """The exit status once the run has ended, else None."""
        if self.run is not None:
            return self.run.returncode if self.run.ended.is_set() else None
        return self.process.poll()

    def signal(self, sig: int) -> None:
        """``sig`` to the run, if it still runs (SIGKILL by its parent, the zygote: never a reused pid)."""
        if self.run is None:
            self.process.send_signal(sig)
        elif sig == signal.SIGKILL:
            self.zygote.kill(self.run)
        elif not self.run.ended.is_set():
            os.kill(self.run.pid, sig)

    def kill_group(self) -> None:
        """SIGKILL to the run's process group (it was started with ``new_session``): the run and every process it
        started that stayed in its group."""
        if not self.new_session:
            raise ValueError("kill_group needs a run started with new_session=True")
        if self.run is not None:
            self.zygote.kill(self.run, group=True)
        elif self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)

    def wait(self, timeout: float = GRACE_S) -> int | None:
        """The exit status once the run has ended (None: still running after ``timeout``)."""
        if self.run is not None:
            self.run.ended.wait(timeout)
            return self.poll()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout)
        return self.poll()

    def output(self) -> tuple[str, str]:
        """What the run wrote to stdout and stderr so far."""
        if self.run is not None:
            return self.run.output()
        return tuple((self.folder / name).read_text(errors="replace") for name in ("out", "err"))


def start(argv: Sequence[str], cwd: Path, env: Mapping[str, str]) -> Started:
    """``python -m monai.bundle *argv`` from ``cwd`` with ``env``, left running (see :class:`Started`)."""
    return Started([*BUNDLE, *argv], cwd, env)


def start_python(args: Sequence[str], cwd: Path, env: Mapping[str, str] | None = None,
                 new_session: bool = False) -> Started:  # fmt: skip
    """``python *args`` from ``cwd`` with ``env`` (default: this process's), left running (see :class:`Started`)."""
    return Started(args, cwd, dict(os.environ) if env is None else env, new_session)


def _stop() -> None:
    for zygote in _ZYGOTES:
        zygote.close()


# --- the zygote itself -------------------------------------------------------------------------------------------


def _search_path(first: str, pythonpath: str | None, base: Sequence[str]) -> list[str]:
    """``sys.path`` as ``python`` sets it: ``first`` (the working directory for ``-m``, ``""`` for ``-c``, the
    script's folder), then PYTHONPATH's entries made absolute, then the interpreter's own, each once."""
    entries = [os.path.abspath(p) for p in pythonpath.split(os.pathsep)] if pythonpath else []
    return [first, *dict.fromkeys([*entries, *base])]


def _exit_status(code: object) -> int:
    """The exit status of ``SystemExit(code)``, as the interpreter gives it (a message: printed, status 1)."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


class _Setup(NamedTuple):
    """What every child starts from: the interpreter's own ``sys.path``, what the imports wrote to stdout and stderr,
    the environment the zygote started with, the variables its imports set (name: [before, after]), and the prefixes
    of those it never reads (:data:`GPU_ENV` where its torch has no GPU build)."""

    base: list[str]
    preamble: tuple[bytes, bytes]
    env: dict[str, str]
    imports_env: dict[str, list]
    unread: list[str]


def _child(request: dict, inherited: Sequence[int], setup: _Setup, fds: Sequence[int] = ()) -> NoReturn:
    """The forked child: set up as ``python *args`` sets up a process, run it, end as the interpreter ends. ``fds``:
    the client's fds 0-2 (a socket's run), else stdout and stderr go to the request's files."""
    status = 1
    try:
        for fd in inherited:
            os.close(fd)
        if request.get("new_session"):
            os.setsid()
        kind, target, rest = python_form(request["args"])
        preamble = setup.preamble if request["args"][:2] == list(BUNDLE) else (b"", b"")
        if fds:
            for fd, received in enumerate(fds):
                os.dup2(received, fd)
            for received in fds:
                if received > 2:
                    os.close(received)
        else:
            flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
            for fd, name in ((1, "stdout"), (2, "stderr")):
                opened = os.open(request[name], flags, 0o644)
                os.dup2(opened, fd)
                os.close(opened)
        for fd, text in zip((1, 2), preamble):
            os.write(fd, text)
        # the interpreter's own streams, now on the run's fds: set up as for a pipe (as subprocess's), and the very
        # objects that loggers made by the imports write to, flushed as the run ends; a client started with ``-u``
        # (torchrun starts its ranks so): written through at each line
        sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__
        if request.get("unbuffered"):
            for stream in (sys.stdout, sys.stderr):
                stream.reconfigure(line_buffering=True, write_through=True)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        for name, (before, after) in setup.imports_env.items():  # as the imports would have left it
            if os.environ.get(name) == before:
                if after is None:
                    del os.environ[name]
                else:
                    os.environ[name] = after
        tempfile.tempdir = None  # TMPDIR as the run's environment says
        if set(request["cpus"]) != os.sched_getaffinity(0):
            os.sched_setaffinity(0, request["cpus"])
        first = {"module": os.getcwd(), "code": ""}.get(kind, os.path.dirname(os.path.realpath(target)))
        sys.path[:] = _search_path(first, request["env"].get("PYTHONPATH"), setup.base)
        importlib.invalidate_caches()
        sys.argv = [{"module": "-m", "code": "-c"}.get(kind, target), *rest]
        sys.orig_argv = [sys.executable, *request["args"]]
        if "numpy.random" in sys.modules:  # a process of its own seeds numpy's global generator afresh (random's:
            sys.modules["numpy.random"].seed()  # at fork)
        if "multiprocessing.process" in sys.modules:  # and makes its own authentication key
            process = sys.modules["multiprocessing.process"]
            process.current_process().authkey = os.urandom(32)
    except Exception:
        traceback.print_exc()
        _finish(status)
    try:
        if kind == "module":
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        elif kind == "path":
            runpy.run_path(target, run_name="__main__")
        else:  # a fresh __main__, as ``python -c`` runs its code in
            main = types.ModuleType("__main__")
            main.__dict__["__builtins__"] = builtins
            sys.modules["__main__"] = main
            try:
                code = compile(target, "<string>", "exec")
            except SyntaxError as error:  # printed as the interpreter prints it: no traceback
                traceback.print_exception(type(error), error, None)
                _finish(1)
            exec(code, main.__dict__)
        status = 0
    except SystemExit as stop:
        status = _exit_status(stop.code)
    except KeyboardInterrupt:  # the interpreter ends such a process by SIGINT
        traceback.print_exc()
        sys.stderr.flush()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    except Exception as error:  # what the interpreter prints of an uncaught exception (from the run's own frames)
        error = error.with_traceback(error.__traceback__.tb_next)  # the hook prints the exception's own
        sys.excepthook(type(error), error, error.__traceback__)
    _finish(status)


def _finish(status: int) -> NoReturn:
    """End as the interpreter ends a process: join non-daemon threads, run the ``atexit`` handlers, flush."""
    try:
        threading._shutdown()
    except Exception:
        traceback.print_exc()
    atexit._run_exitfuncs()
    for stream, failed in ((sys.stdout, 120), (sys.stderr, status), (sys.__stdout__, status), (sys.__stderr__, status)):
        try:
            stream.flush()
        except Exception:
            status = failed
    os._exit(status)


class _Child(NamedTuple):
    """A child the zygote forked: its pid, the pipe's run id, or the socket connection that asked for it."""

    pid: int
    run_id: int | None
    connection: socket.socket | None
    new_session: bool


def _read_request(connection: socket.socket) -> tuple[dict, list[int]]:
    """A socket client's request (one JSON line) and the fds sent with its first bytes."""
    connection.settimeout(GRACE_S)
    data, fds, _, _ = socket.recv_fds(connection, 1 << 16, 3)
    while not data.endswith(b"\n"):
        chunk = connection.recv(1 << 16)
        if not chunk:
            raise OSError("the client closed its connection before its request ended")
        data += chunk
    connection.settimeout(None)
    return json.loads(data), fds


def _refusal(request: dict, setup: _Setup) -> str | None:
    """Why the zygote does not run a socket client's request (the client then runs it itself), or None."""
    if python_form(request.get("args", [])) is None:
        return f"python {' '.join(request.get('args', []))}: a form the zygote does not run"
    names = differing_settings(setup.env, request["env"], setup.imports_env, setup.unread)
    return f"its environment sets {', '.join(names)} otherwise than the zygote's" if names else None


def _serve(requests: int, answers: int, log: int, listener: socket.socket, setup: _Setup) -> None:
    """Fork a child per request (the pipe's, or a socket client's), answer its pid, and its exit status when it ends,
    until the pipe's requests end. A socket client's connection that closes while its child runs: the child's session
    is killed."""

    def answer(message: dict) -> None:
        os.write(answers, json.dumps(message).encode() + b"\n")

    def fork(request: dict, fds: Sequence[int] = (), connection: socket.socket | None = None) -> tuple[int, int]:
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            try:
                open_fds = [requests, answers, log, listener.fileno(), *running, *clients]
                _child(request, open_fds + ([connection.fileno()] if connection else []), setup, fds)
            finally:  # never back into the zygote's loop
                os._exit(1)
        pidfd = os.pidfd_open(pid)
        running[pidfd] = _Child(pid, request.get("id"), connection, bool(request.get("new_session")))
        return pid, pidfd

    def kill(child: _Child, group: bool) -> None:
        with contextlib.suppress(OSError):
            os.killpg(child.pid, signal.SIGKILL) if group else os.kill(child.pid, signal.SIGKILL)

    running: dict[int, _Child] = {}  # pidfd: the child
    clients: dict[int, int] = {}  # a socket client's connection fd: its child's pidfd
    pending = b""
    while True:
        ready, _, _ = select.select([requests, listener.fileno(), *running, *clients], [], [])
        for fd in ready:
            if fd in running:
                child = running.pop(fd)
                os.close(fd)
                _, status = os.waitpid(child.pid, 0)
                code = os.waitstatus_to_exitcode(status)
                if child.connection is None:
                    answer({"id": child.run_id, "returncode": code})
                elif clients.pop(child.connection.fileno(), None) is not None:
                    with contextlib.suppress(OSError):
                        child.connection.sendall(json.dumps({"returncode": code}).encode() + b"\n")
                    child.connection.close()
            elif fd in clients:  # a client wrote nothing it should: it ended (killed), and its run goes with it
                child = running[clients.pop(fd)]
                kill(child, group=child.new_session)
                child.connection.close()
            elif fd == listener.fileno():
                connection, _ = listener.accept()
                fds: list[int] = []
                try:
                    request, fds = _read_request(connection)
                    why = _refusal(request, setup)
                    if why is None:
                        pid, clients[connection.fileno()] = fork({**request, "new_session": True}, fds, connection)
                        connection.sendall(json.dumps({"pid": pid}).encode() + b"\n")
                    else:
                        print(f"refused a socket client: {why}", file=sys.stderr, flush=True)
                        connection.sendall(json.dumps({"refused": why}).encode() + b"\n")
                except (OSError, ValueError, KeyError) as error:
                    print(f"a socket client's request failed: {error}", file=sys.stderr, flush=True)
                finally:
                    for received in fds:
                        os.close(received)
                    if connection.fileno() not in clients:
                        connection.close()
            else:
                chunk = os.read(requests, 1 << 16)
                if not chunk:
                    return
                *lines, pending = (pending + chunk).split(b"\n")
                for line in lines:
                    request = json.loads(line)
                    if "kill" in request:
                        for child in running.values():
                            if child.run_id == request["kill"]:
                                kill(child, group=request.get("group", False) and child.new_session)
                        continue
                    try:
                        pid, _ = fork(request)
                    except OSError as error:
                        answer({"id": request["id"], "error": str(error)})
                        continue
                    answer({"id": request["id"], "pid": pid})


def _zygote_main(folder: Path) -> None:
    """Import :data:`PRELOADED` with stdout and stderr kept (each child writes them first), then serve."""
    here = str(Path(SCRIPT).parent)
    if sys.path and sys.path[0] == here:  # the script's folder: not on a run's path
        del sys.path[0]
    base = list(sys.path)
    requests, answers, log = os.dup(0), os.dup(1), os.dup(2)  # fds 0-2: /dev/null, the imports' output, the log
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    kept = [folder / "import.out", folder / "import.err"]
    for fd, path in enumerate(kept, start=1):
        opened = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(opened, fd)
        os.close(opened)
    before = dict(os.environ)
    for name in PRELOADED:
        importlib.import_module(name)
    sys.stdout.flush()
    sys.stderr.flush()
    imports_env = {k: [before.get(k), os.environ.get(k)] for k in {*before, *os.environ}
                   if before.get(k) != os.environ.get(k)}  # fmt: skip
    torch = sys.modules["torch"]
    unread = [] if torch.version.cuda or torch.version.hip else list(GPU_ENV)
    setup = _Setup(base, (kept[0].read_bytes(), kept[1].read_bytes()), before, imports_env, unread)
    os.dup2(log, 1)
    os.dup2(log, 2)
    ready = {"ready": True, "pid": os.getpid(), "python_threads": threading.active_count(),
             "threads": len(os.listdir("/proc/self/task")), "imports_env": imports_env, "unread": unread}  # fmt: skip
    if ready["python_threads"] != 1 or not hasattr(os, "pidfd_open"):
        print(f"not fork-safe here: {ready}, pidfd_open: {hasattr(os, 'pidfd_open')}", file=sys.stderr)
        return
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(folder / SOCKET_NAME))
    listener.listen(16)
    os.write(answers, json.dumps(ready).encode() + b"\n")
    with contextlib.suppress(KeyboardInterrupt):
        _serve(requests, answers, log, listener, setup)
    listener.close()
    shutil.rmtree(folder, ignore_errors=True)


# --- a socket client: python zygote.py --exec ARGS -------------------------------------------------------------------


def _exec_main(args: list[str]) -> NoReturn:
    """Run ``python *args`` from the zygote named by :data:`SOCKET_ENV` on this process's fds 0-2, passing on
    :data:`PASSED_ON` and ending as the run ended; ``exec`` it here where the zygote refuses or cannot be reached."""
    path = os.environ.get(SOCKET_ENV)
    answer: dict = {}
    if path:
        client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        request = {"args": args, "cwd": os.getcwd(), "env": dict(os.environ), "cpus": sorted(os.sched_getaffinity(0)),
                   "unbuffered": "-u" in itertools.takewhile(lambda a: a.startswith("-"), sys.orig_argv[1:])
                   or bool(os.environ.get("PYTHONUNBUFFERED"))}  # fmt: skip
        with contextlib.suppress(OSError, ValueError):
            client.connect(path)
            data = json.dumps(request).encode() + b"\n"
            sent = socket.send_fds(client, [data[: 1 << 15]], [0, 1, 2])
            client.sendall(data[sent:])
            reader = client.makefile("rb")
            answer = json.loads(reader.readline() or b"{}")
    if "pid" not in answer:
        os.execv(sys.executable, [sys.executable, *args])
    pid = answer["pid"]
    for sig in PASSED_ON:
        signal.signal(sig, lambda number, _frame: os.kill(pid, number))
    line = reader.readline()  # the run's end (a signal passed on in between: the read goes on, PEP 475)
    code = json.loads(line).get("returncode", 1) if line.strip() else 1
    if code < 0:  # ended by a signal: end by the same one
        with contextlib.suppress(OSError, ValueError):  # SIGKILL has no handler to reset
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--exec"]:
        _exec_main(sys.argv[2:])
    if sys.argv[1:2] == ["--torchrun"]:  # the torchrun of :func:`shims`
        os.execv(sys.executable, [sys.executable, "-m", "torch.distributed.run", *torchrun_args(sys.argv[2:])])
    _zygote_main(Path(sys.argv[1]))
else:
    atexit.register(_stop)
