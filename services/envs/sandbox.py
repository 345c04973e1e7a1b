"""Run an untrusted Python program in a subprocess with limits (the code environment's sandbox).

What is enforced, on Linux:
* **time**: ``RLIMIT_CPU`` of ``cpu_s`` seconds in the child, and a wall-clock
  timeout (``wall_s``) after which the whole process group is killed;
* **memory**: ``RLIMIT_AS`` (address space) of ``memory_mb``;
* **processes / files**: ``RLIMIT_NPROC`` 0 (no fork bombs; the kernel does not
  apply it to root, so a run as root can still fork — the CPU, memory and wall
  limits and the process-group kill still hold), ``RLIMIT_FSIZE`` 1 MiB (no
  large writes), ``RLIMIT_CORE`` 0, ``RLIMIT_NOFILE`` 64;
* **network**: the program runs in a new, empty network namespace
  (``unshare --net --map-root-user``) when the kernel permits user namespaces
  (checked once); otherwise it runs without one and ``network_isolated`` is False
  in the result — the environment is still stripped (no proxies, no HOME);
* **environment**: an empty environment (only PATH and a UTF-8 locale),
  ``python -I -S`` (isolated: no user site, no ``PYTHON*`` variables), a fresh
  temporary working directory, deleted afterwards; stdin is closed; output is
  capped at ``max_output`` bytes.
It is not a security boundary against a determined attacker (no seccomp, the
filesystem is readable); it keeps buggy or runaway candidate programs from
hurting the run.
"""

from __future__ import annotations

import functools
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass


@dataclass
class RunResult:
    returncode: int | None  # None: killed by the wall-clock timeout
    stdout: str
    stderr: str
    timed_out: bool
    network_isolated: bool


@functools.cache
def can_unshare_net() -> bool:
    exe = shutil.which("unshare")
    if exe is None:
        return False
    try:
        return subprocess.run([exe, "--net", "--map-root-user", "true"], capture_output=True,
                              timeout=10).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def _limits(cpu_s: int, memory_mb: int) -> None:  # runs in the child between fork and exec
    os.setsid()
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))
    resource.setrlimit(resource.RLIMIT_AS, (memory_mb << 20, memory_mb << 20))
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
    resource.setrlimit(resource.RLIMIT_NPROC, (0, 0))


def run_python(source: str, *, cpu_s: int = 2, wall_s: float = 5.0, memory_mb: int = 256,
               max_output: int = 65536) -> RunResult:
    """Run ``source`` as a Python program under the limits above."""
    work = tempfile.mkdtemp(prefix="tandem-sandbox-")
    try:
        path = os.path.join(work, "main.py")
        with open(path, "w") as fh:
            fh.write(source)
        cmd = [sys.executable, "-I", "-S", path]
        isolated = can_unshare_net()
        if isolated:
            cmd = ["unshare", "--net", "--map-root-user", *cmd]
        env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}
        proc = subprocess.Popen(cmd, cwd=work, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, preexec_fn=lambda: _limits(cpu_s, memory_mb))
        try:
            out, err = proc.communicate(timeout=wall_s)
            timed_out = False
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            timed_out = True
        return RunResult(None if timed_out else proc.returncode, out[:max_output].decode(errors="replace"),
                         err[:max_output].decode(errors="replace"), timed_out, isolated)
    finally:
        shutil.rmtree(work, ignore_errors=True)
