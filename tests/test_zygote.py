"""The tests' fork server (tests/zygote.py): a run forked from it is set up as ``python ARGS`` sets up a process of its
own, in each form the tests use (``-m``, ``-c``, a script), and a process the tests do not start themselves reaches it
through ``python zygote.py --exec``, which passes on signals, ends as its run ended, and takes its run with it when it
is killed."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import time
from pathlib import Path

import pytest
import zygote

SHOW = "import sys; print(sys.argv, repr(sys.path[0]), __name__, flush=True)"


def test_each_form_gets_the_argv_path_and_main_python_gives_it(tmp_path):
    script = tmp_path / "tool" / "show.py"
    script.parent.mkdir()
    script.write_text(f"{SHOW}\nraise SystemExit(4)\n")
    code = zygote.run_python(["-c", f"{SHOW}; sys.exit(3)", "a", "b"], tmp_path)
    assert (code.returncode, code.stdout) == (3, "['-c', 'a', 'b'] '' __main__\n")
    path = zygote.run_python([str(script), "x"], Path("/"))
    assert (path.returncode, path.stdout) == (4, f"[{str(script)!r}, 'x'] {str(script.parent)!r} __main__\n")
    module = zygote.run_python(["-m", "json.tool", "--help"], tmp_path)
    assert module.returncode == 0 and module.stdout.startswith("usage: python -m json.tool")


def test_errors_are_printed_as_the_interpreter_prints_them(tmp_path):
    syntax = zygote.run_python(["-c", "print('no'"], tmp_path)
    assert syntax.returncode == 1 and syntax.stderr.startswith('  File "<string>", line 1'), syntax.stderr
    assert "SyntaxError" in syntax.stderr and "zygote" not in syntax.stderr
    raised = zygote.run_python(["-c", "def f():\n    raise KeyError('k')\nf()"], tmp_path)
    lines = raised.stderr.splitlines()
    assert raised.returncode == 1 and lines[0] == "Traceback (most recent call last):", raised.stderr
    assert lines[1] == '  File "<string>", line 3, in <module>' and lines[-1] == "KeyError: 'k'", raised.stderr


@pytest.fixture(scope="module")
def launcher() -> tuple[list[str], dict[str, str]]:
    launch = zygote.launcher()
    if launch is None:
        pytest.skip("no zygote serves this process (BUNDLE_RUN_SUBPROCESS=1, or it could not start)")
    command, variables = launch
    return command, {**os.environ, **variables}


def wait_for_file(path: Path, timeout: float = 60) -> str:
    deadline = time.monotonic() + timeout
    while not (path.exists() and path.read_text()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return path.read_text()


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie has ended)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_launched_run_writes_to_the_launchers_fds_and_ends_with_its_status(launcher, tmp_path):
    command, env = launcher
    done = subprocess.run([*command, "-c", "import sys, torch; print('ran', sys.argv[1:]); sys.exit(5)", "q"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert (done.returncode, done.stdout) == (5, "ran ['q']\n"), done.stderr
    killed = subprocess.run([*command, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"], cwd=tmp_path,
                            env=env, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert (killed.returncode, killed.stderr) == (-signal.SIGKILL, ""), "killed, as the run was"


def test_a_signal_to_the_launcher_reaches_the_run_and_killing_the_launcher_kills_the_run(launcher, tmp_path):
    command, env = launcher
    pid_file = tmp_path / "pid"
    sleeper = ["-c", f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(300)"]
    client = subprocess.Popen([*command, *sleeper], cwd=tmp_path, env=env)
    run = int(wait_for_file(pid_file))
    assert run != client.pid and alive(run)
    client.send_signal(signal.SIGTERM)
    assert client.wait(60) == -signal.SIGTERM, "the run ended by SIGTERM, and the launcher as it did"
    assert not alive(run)

    pid_file.unlink()
    group = subprocess.Popen(["bash", "-c", shlex.join([*command, *sleeper])], cwd=tmp_path, env=env,
                             start_new_session=True)  # fmt: skip
    run = int(wait_for_file(pid_file))
    os.killpg(group.pid, signal.SIGKILL)  # the launcher's group, as a test kills a command and what it started
    group.wait()
    deadline = time.monotonic() + 30
    while alive(run) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(run), "the run died with its launcher"


def test_a_run_whose_start_up_settings_differ_is_run_by_the_launcher_itself(launcher, tmp_path):
    command, env = launcher
    code = "import os, sys; print(os.environ['OMP_NUM_THREADS'], os.getppid() == int(sys.argv[1]))"
    done = subprocess.run([*command, "-c", code, str(os.getpid())], cwd=tmp_path, capture_output=True, text=True,
                          env={**env, "OMP_NUM_THREADS": "7"}, timeout=120)  # fmt: skip
    assert (done.returncode, done.stdout) == (0, "7 True\n"), done.stderr
