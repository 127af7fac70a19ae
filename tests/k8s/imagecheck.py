"""What a rendered container needs from its image, and what each Dockerfile installs.

Two halves, both computed from the real sources (no hand-kept command -> extra table that
could drift from the code):

- `command_needs(argv)`: the third-party modules a `kubetune ...` container command can
  import. The CLI's startup (kubetune.cli and the command groups it registers, module level
  only) plus the command function's body, then every import in every kubetune module those
  reach, module level or inside a function (the components import grpc, fastapi and the
  kubernetes client lazily, which is exactly what a look at module level alone would miss).
  Imports guarded by `except ImportError` (optional) and `if TYPE_CHECKING:` are left out.
- `installed(dockerfile)`: the distributions its `pip install` lines leave in the image:
  the project with the extras named in `".[...]"` (read from pyproject.toml, so a new
  extra counts before the venv is reinstalled), the packages named, and everything those
  require (the installed metadata of this environment), except after `--no-deps`.
"""

from __future__ import annotations

import ast
import functools
import importlib.metadata as md
import re
import shlex
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: mypy (a dev dependency) brings tomli
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[2]
SRC = REPO / "src"
PROJECT = "kubetune"

# Modules of a vendor SDK that comes with its base image, not from pip, and that kubetune
# imports only on that vendor's hardware (the `hpu` device): never on another image.
BASE_IMAGE_MODULES = {"habana_frameworks": "Dockerfile.gaudi"}
# Commands that are not kubetune: coreutils, in every base image (python:slim, Intel's Ubuntu).
BASE_TOOLS = {"sleep"}
# pip options that take a value (the value is not a requirement)
_PIP_VALUE_OPTIONS = {"-c", "--constraint", "-r", "--requirement", "-i", "--index-url", "--extra-index-url", "-f"}


# ------------------------------------------------------------------------- the command side


@dataclass(frozen=True)
class Need:
    module: str  # top-level module, e.g. grpc
    via: str  # the kubetune module (or command) that imports it


def _module_file(name: str) -> tuple[Path, bool] | None:
    """kubetune.a.b -> (its source file, is a package), or None (not a kubetune module file)."""
    path = SRC / name.replace(".", "/")
    if (path / "__init__.py").is_file():
        return path / "__init__.py", True
    if path.with_suffix(".py").is_file():
        return path.with_suffix(".py"), False
    return None


def _optional(handlers: list[ast.ExceptHandler]) -> bool:
    """`try: import x / except ImportError: <fallback>`: x is optional, unless the handler raises
    (`raise UserError("pip install ...")` means the command cannot work without it)."""
    for h in handlers:
        kinds = h.type.elts if isinstance(h.type, ast.Tuple) else [h.type]
        names = {k.id for k in kinds if isinstance(k, ast.Name)}
        if names & {"ImportError", "ModuleNotFoundError"}:
            return not any(isinstance(n, ast.Raise) for n in ast.walk(ast.Module(body=h.body, type_ignores=[])))
    return False


def _type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(nodes: list[ast.stmt], package: str, module_level_only: bool) -> list[str]:
    """Dotted names imported by these statements (both `a.b` and `a.b.name` for `from a.b import name`)."""
    found: list[str] = []
    for node in nodes:
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}" if base else parent
            found += [base] + [f"{base}.{a.name}" for a in node.names]
        elif isinstance(node, ast.If) and _type_checking(node.test):
            found += _imports(node.orelse, package, module_level_only)
        elif isinstance(node, ast.Try) and _optional(node.handlers):
            found += _imports(node.orelse + node.finalbody, package, module_level_only)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and module_level_only:
            continue
        elif isinstance(node, ast.Expr) and isinstance(node.value, ast.Call):
            # `_register_optional("kubetune.k8s.cli", ...)`, `import_module("...")`: a literal module name
            literals = [a.value for a in node.value.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
            found += [m for m in literals if m.startswith(PROJECT + ".")]
        else:  # compound statements (if, for, with, try, function and class bodies): look inside
            for field in ("body", "orelse", "finalbody", "handlers"):
                found += _imports(getattr(node, field, []), package, module_level_only)
    return found


def _parse(name: str) -> tuple[ast.Module, str] | None:
    located = _module_file(name)
    if located is None:
        return None
    path, is_package = located
    return ast.parse(path.read_text()), name if is_package else name.rpartition(".")[0]


def _startup() -> tuple[list[tuple[str, str]], set[str]]:
    """What `kubetune <anything>` imports before the command runs: the module level of
    kubetune.cli and of the command groups it registers (-> roots, the entry modules)."""
    todo, roots, entries = ["kubetune.cli"], [], set()
    while todo:
        name = todo.pop()
        parsed = _parse(name)
        if parsed is None or name in entries:
            continue
        entries.add(name)
        parts = name.split(".")
        roots += [(".".join(parts[:i]), name) for i in range(1, len(parts))]  # its packages' __init__ run
        for imported in _imports(parsed[0].body, parsed[1], module_level_only=True):
            if imported.startswith(PROJECT + ".") and imported.endswith(".cli"):
                todo.append(imported)  # a registered command group: only its module level runs at startup
            else:
                roots.append((imported, name))
    return roots, entries


def _closure(roots: list[tuple[str, str]], entries: set[str]) -> dict[str, str]:
    """Top-level third-party module -> the kubetune module that imports it, over every import reached
    (the entry modules count with their module level only: they are in `roots` already)."""
    needs: dict[str, str] = {}
    seen = set(entries)
    todo = list(roots)
    while todo:
        name, via = todo.pop()
        top = name.split(".")[0]
        if top != PROJECT:
            if top and top not in sys.stdlib_module_names:
                needs.setdefault(top, via)
            continue
        if name in seen:
            continue
        seen.add(name)
        parts = name.split(".")
        todo += [(".".join(parts[:i]), via) for i in range(1, len(parts))]  # importing a.b.c runs a and a.b
        parsed = _parse(name)
        if parsed is not None:
            tree, package = parsed
            todo += [(imported, name) for imported in _imports(tree.body, package, module_level_only=False)]
    return needs


def command_function(argv: list[str]):
    """`["kubetune", "k8s", "render-components", ...]` -> the Python function that command runs."""
    import typer.main

    from kubetune import cli

    command = typer.main.get_command(cli.app)
    for token in argv[1:]:  # down the command groups (typer vendors its own click: duck-typed)
        if token not in getattr(command, "commands", {}):
            break
        command = command.commands[token]
    # a group runs its own callback when it is given no subcommand and allows that (`kubetune operator -A`)
    runs_itself = not hasattr(command, "commands") or getattr(command, "invoke_without_command", False)
    assert runs_itself and command.callback, f"{argv}: not a kubetune command"
    function = command.callback
    while hasattr(function, "__wrapped__"):  # typer wraps the declared function
        function = function.__wrapped__
    return function


def command_needs(argv: list[str]) -> list[Need]:
    return _function_needs(command_function(argv), " ".join(argv[:2]))


@functools.cache
def _function_needs(function, label: str) -> list[Need]:
    body = ast.parse(textwrap.dedent(_source(function))).body
    label = f"`{label}` ({function.__module__}.{function.__name__})"
    package = function.__module__.rpartition(".")[0]
    roots, entries = _startup()
    roots += [(name, label) for name in _imports(body, package, module_level_only=False)]
    return [Need(module, via) for module, via in sorted(_closure(roots, entries).items())]


def _source(function) -> str:
    import inspect

    return inspect.getsource(function)


# ---------------------------------------------------------------------------- the image side


def _pip_installs(dockerfile: Path) -> list[tuple[list[str], bool]]:
    """Each `pip install` in the RUN lines -> (requirement strings, --no-deps given)."""
    text = re.sub(r"\\\n", " ", dockerfile.read_text())
    runs = [line.split(None, 1)[1] for line in text.splitlines() if line.startswith("RUN ")]
    found = []
    for words in (command for run in runs for command in _commands(run)):
        if "pip" not in words[:3] or "install" not in words:
            continue
        args = words[words.index("install") + 1 :]
        reqs, skip = [], False
        for word in args:
            if skip:
                skip = False
            elif word in _PIP_VALUE_OPTIONS:
                skip = True
            elif not word.startswith("-"):
                reqs.append(word)
        found.append((reqs, "--no-deps" in args))
    return found


def _commands(run: str) -> list[list[str]]:
    """A RUN line's shell commands, each as words (quotes respected; split at && ; |)."""
    lexer = shlex.shlex(run, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    commands: list[list[str]] = [[]]
    for token in lexer:
        if token in ("&&", ";", "|", "||"):
            commands.append([])
        else:
            commands[-1].append(token)
    return commands


def _project_requirements(extras: set[str]) -> list[Requirement]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    unknown = extras - set(project["optional-dependencies"])
    assert not unknown, f"pyproject.toml has no extra {sorted(unknown)}"
    lines = list(project["dependencies"])
    for extra in sorted(extras):
        lines += project["optional-dependencies"][extra]
    return [Requirement(line) for line in lines]


def _requirements_of(name: str, extras: set[str]) -> list[Requirement]:
    try:
        declared = md.requires(name) or []
    except md.PackageNotFoundError:
        return []  # not installed here (another platform's marker): nothing of it is imported here either
    reqs = []
    for line in declared:
        req = Requirement(line)
        if req.marker is None or any(req.marker.evaluate({"extra": e}) for e in (extras or {""})):
            reqs.append(req)
    return reqs


@functools.cache
def installed(dockerfile: Path) -> frozenset[str]:
    """Canonical names of the distributions this Dockerfile's pip lines install."""
    dists: set[str] = set()
    todo: list[Requirement] = []
    for reqs, no_deps in _pip_installs(dockerfile):
        for text in reqs:
            match = re.fullmatch(r"\.\[([\w,-]+)\]|\.", text)
            if match:
                dists.add(PROJECT)
                todo += _project_requirements(set(filter(None, (match.group(1) or "").split(","))))
            elif no_deps:
                dists.add(canonicalize_name(Requirement(text).name))
            else:
                todo.append(Requirement(text))
    while todo:
        req = todo.pop()
        name = canonicalize_name(req.name)
        if name in dists and not req.extras:
            continue
        dists.add(name)
        todo += _requirements_of(req.name, set(req.extras))
    return frozenset(dists)


def distributions_of(module: str) -> list[str]:
    """Canonical names of the distributions that ship this top-level module (empty: none installed here).
    A namespace package (`google`) has several: any one of them installed counts."""
    return sorted({canonicalize_name(d) for d in _packages_distributions().get(module, [])})


@functools.lru_cache(maxsize=1)
def _packages_distributions() -> dict[str, list[str]]:
    return dict(md.packages_distributions())


def problems(argv: list[str], dockerfile: Path) -> list[str]:
    """One line per module `argv` can import that the image built by `dockerfile` does not install."""
    if argv[0] != PROJECT:
        return [] if argv[0] in BASE_TOOLS else [f"`{' '.join(argv)}`: not kubetune nor a tool of every base image"]
    have = installed(dockerfile)
    found = []
    for need in command_needs(argv):
        if need.module in BASE_IMAGE_MODULES:
            continue  # the vendor SDK: in its base image, imported only on its hardware
        dists = distributions_of(need.module)
        if not set(dists) & have:
            found.append(
                f"`{' '.join(argv[:2])}` imports {need.module} (distribution {'/'.join(dists) or '?'}, via "
                f"{need.via}), which {dockerfile.name} does not install: add the extra that has it to its pip line"
            )
    return found


# ------------------------------------------------------------------------ images <-> Dockerfiles


def dockerfile_tags(dockerfiles: list[str]) -> dict[str, str]:
    """Image tag -> the Dockerfile that builds it, from each Dockerfile's own `docker build ... -t NAME:TAG` line."""
    tags = {}
    for name in dockerfiles:
        match = re.search(r"docker build (?:-f (\S+) )?-t \S+?:(\S+) \.", (REPO / name).read_text())
        assert match and (match.group(1) or "Dockerfile") == name, f"{name}: no `docker build -t NAME:TAG .` line"
        tags[match.group(2)] = name
    return tags
