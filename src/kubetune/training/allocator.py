"""jemalloc for training processes, where the machine has it.

A CPU training step allocates and frees hundreds of activation tensors of a few to tens of
megabytes whose sizes change with every batch (packed samples of varying lengths). glibc's
malloc serves those sizes from its heap and fragments it: the default recipe's step holds
~3.2 GB of live tensors but its resident memory peaked at 8.0 GB. Forcing glibc to mmap
large blocks returns the memory but pays a page fault per fresh page (15-20% slower steps).
jemalloc, which Intel's PyTorch launch scripts preload for the same reason, gave 3.9 GB and
slightly faster steps (BENCHMARKS.md, "Where the memory goes").

The allocator is chosen when a process starts, so `kubetune train` re-executes itself once
with jemalloc in LD_PRELOAD when the library is installed (Debian/Ubuntu: libjemalloc2; the
kubetune images carry it) and not yet loaded; its torchrun workers inherit the variable.
KUBETUNE_ALLOCATOR=system keeps glibc's malloc. Nothing here imports torch.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ENV = "KUBETUNE_ALLOCATOR"  # auto (default): jemalloc where installed | system
_REEXEC_MARK = "KUBETUNE_ALLOCATOR_REEXEC"
SEARCH = (
    "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2",
    "/usr/lib/aarch64-linux-gnu/libjemalloc.so.2",
    "/usr/lib64/libjemalloc.so.2",
    "/usr/lib/libjemalloc.so.2",
    "/usr/local/lib/libjemalloc.so.2",
    "/usr/local/lib/libjemalloc.so",
)


def find_jemalloc(search: tuple[str, ...] = SEARCH) -> str | None:
    """The jemalloc shared library: in this Python's prefix (a conda env), then system paths."""
    for candidate in (str(Path(sys.prefix) / "lib" / "libjemalloc.so.2"), *search):
        if Path(candidate).is_file():
            return candidate
    return None


def jemalloc_loaded(maps: Path = Path("/proc/self/maps")) -> bool:
    try:
        return "libjemalloc" in maps.read_text()
    except OSError:
        return False


def describe() -> str:
    """One phrase for the run's log: which allocator this process runs on."""
    if jemalloc_loaded():
        return "jemalloc"
    if os.environ.get(ENV, "auto") == "system":
        return f"glibc malloc ({ENV}=system)"
    if find_jemalloc() is not None:
        return "glibc malloc (jemalloc is installed but only the `kubetune train` command preloads it)"
    return "glibc malloc (jemalloc not installed: apt-get install libjemalloc2 halves a CPU step's peak memory)"


def preload_env(env: dict[str, str], library: str) -> dict[str, str]:
    """`env` with `library` first in LD_PRELOAD."""
    preload = [p for p in env.get("LD_PRELOAD", "").split(":") if p and p != library]
    return {**env, "LD_PRELOAD": ":".join([library, *preload]), _REEXEC_MARK: "1"}


def started_as_kubetune(argv: list[str]) -> bool:
    """Whether this process is the kubetune command itself (`kubetune ...`, `python -m
    kubetune ...`), not a program that calls its CLI in-process (a test runner, a notebook)."""
    if len(argv) >= 3 and argv[1] == "-m":
        return argv[2].split(".")[0] == "kubetune"
    return len(argv) >= 2 and Path(argv[1]).name == "kubetune"


def reexec_with_jemalloc() -> None:
    """Replace this process with the same command on jemalloc, when that is wanted, possible
    and not done yet; otherwise return and run on what is loaded."""
    if os.environ.get(ENV, "auto") == "system" or os.environ.get(_REEXEC_MARK) or jemalloc_loaded():
        return
    library = find_jemalloc()
    if library is None or not started_as_kubetune(sys.orig_argv):
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, sys.orig_argv, preload_env(dict(os.environ), library))
