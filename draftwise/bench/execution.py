"""HumanEval pass@1: an answer's code run against its problem's unit tests, in a subprocess, never in this one.

A chat model answers "complete this function" with prose around a fenced block, which may hold the whole
function (its imports too, or not) or only its body. `program_from_answer` builds the program to run:
- the fenced Python blocks are taken (all the fenced blocks when none is marked python; the whole answer when
  there is no fence), and the first one that defines the entry point is kept;
- a block that does not define it is taken as the body: it is appended to the problem's own prompt;
- the prompt's header (its imports, and the helper functions some problems define before the entry point) comes
  first, so a full function that left out `from typing import List` still runs, as the problem intends.
The tests (`check(candidate)`) run after it: the answer passes when the process gets past them (`run_program`)
within the timeout. The process runs `python -I` in an empty temporary directory, with its own session (killed whole at the
timeout), a memory limit, no standard input, and output discarded; this is isolation against accidents, not a
sandbox against hostile code.
"""

from __future__ import annotations

import os
import re
import secrets
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)(?:```|\Z)", re.S)
MEMORY_LIMIT = 1 << 30  # bytes of address space for one test program


def code_blocks(answer: str) -> list[str]:
    """The answer's fenced code blocks marked python (or unmarked), in order; the whole answer when it has none."""
    blocks = [(lang.lower(), body) for lang, body in _FENCE.findall(answer)]
    if not blocks:
        return [answer]
    python = [body for lang, body in blocks if lang in ("python", "py", "python3")]
    return python or [body for _, body in blocks]


def _defines(code: str, name: str) -> bool:
    return re.search(rf"^\s*def\s+{re.escape(name)}\s*\(", code, re.M) is not None


def prompt_header(code_prompt: str, entry_point: str) -> str:
    """The problem prompt up to its entry point's `def` (imports and helper functions)."""
    match = re.search(rf"^def\s+{re.escape(entry_point)}\s*\(", code_prompt, re.M)
    return code_prompt[: match.start()] if match else ""


def program_from_answer(answer: str, code_prompt: str, entry_point: str) -> str:
    """The program whose `entry_point` the tests will call (see the module's docstring)."""
    blocks = code_blocks(answer)
    full = next((b for b in blocks if _defines(b, entry_point)), None)
    if full is not None:
        return prompt_header(code_prompt, entry_point) + "\n" + full
    body = blocks[0]
    if body.strip() and not body.startswith((" ", "\t")):  # a body written flush left: indent it under the def
        body = "".join("    " + line if line.strip() else line for line in body.splitlines(keepends=True))
    return code_prompt + body


def _limits() -> None:  # in the child, before exec
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def run_program(source: str, *, timeout: float = 10.0) -> bool:
    """True when `source` runs to its end within `timeout` seconds, in a separate process: the process prints a
    random token after the source's last statement and exits with status 0 (an answer that calls `sys.exit(0)`
    or `os._exit(0)` before its tests have run does not pass). The source runs as a module named `candidate`, not
    `__main__`, so an answer's own `if __name__ == "__main__":` demo does not run."""
    token = secrets.token_hex(16)
    with tempfile.TemporaryDirectory(prefix="draftwise-exec-") as directory:
        path = os.path.join(directory, "program.py")
        with open(path, "w", encoding="utf-8") as f:
            f.write(f"{source}\n\nprint({token!r}, flush=True)\n")
        launcher = "import runpy, sys; runpy.run_path(sys.argv[1], run_name='candidate')"
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONHASHSEED": "0", "OMP_NUM_THREADS": "1"}
        with open(os.path.join(directory, "stdout"), "w+b") as stdout:
            process = subprocess.Popen(
                [sys.executable, "-I", "-c", launcher, path], cwd=directory, env=env, stdin=subprocess.DEVNULL,
                stdout=stdout, stderr=subprocess.DEVNULL, start_new_session=True,
                preexec_fn=_limits if os.name == "posix" else None,
            )
            try:
                status = process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                return False
            finally:
                if process.poll() is None:
                    try:
                        os.killpg(process.pid, 9)
                    except ProcessLookupError:
                        pass
                    process.wait()
            stdout.seek(max(0, os.fstat(stdout.fileno()).st_size - 256))
            tail = stdout.read().decode("ascii", "replace").split()
        return status == 0 and bool(tail) and tail[-1] == token


def passes(answer: str, code_prompt: str, tests: str, entry_point: str, *, timeout: float = 10.0) -> bool:
    """Whether the answer's code passes the problem's tests (HumanEval's `check(candidate)`)."""
    program = program_from_answer(answer, code_prompt, entry_point)
    return run_program(f"{program}\n\n{tests}\n\ncheck({entry_point})\n", timeout=timeout)


def pass_all(items: Sequence[tuple[str, str, str, str]], *, timeout: float = 10.0, workers: int = 2) -> list[bool]:
    """`passes` for each (answer, code_prompt, tests, entry_point), `workers` subprocesses at a time."""
    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        return list(pool.map(lambda item: passes(*item, timeout=timeout), items))
