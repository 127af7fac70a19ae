"""Install a run's LoRA adapter into a shared server's adapter volume: the command of the
adapter-export Job the operator runs when a FineTune with `spec.serve.server` has trained.

    python -m kubetune.export.adapter_install RUN_DIR --name NAME --version vN --base BASE [--revision R] [--gate]
        [--register mlflow|kubeflow [--registered-name N] [--registry-url URL]]
    python -m kubetune.export.adapter_install --unregister --name NAME --version vN [--delete-files]

copies RUN_DIR/adapter (PEFT format, not merged) to /adapters/NAME/vN atomically, then registers
NAME@vN in /adapters/registry.json (its schema: `kubetune.contracts.adapters`), which every
replica reads at start; the operator then loads it into the running replicas. With `--gate` a
run whose eval gate failed is neither copied nor registered (exit 0; the verdict is the
termination message the operator reads, as `kubetune export --gate` writes it). With
`--register` the installed adapter is then registered in a model registry as `kubetune export
--register` does (named NAME unless --registered-name; what was registered, or why not, in the
termination message). Registry writes
are whole-file (atomic) and made under a lock beside the file, so two Jobs finishing together
do not lose each other's entry. Exit 2 with one line on a problem.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

from kubetune.contracts.adapter_volume import REGISTRY_NAME, ROOT, adapter_dir
from kubetune.contracts.adapters import (
    AdapterRegistry,
    AdapterVersion,
    BaseModelRef,
    RegisteredAdapter,
    read_registry,
    write_registry,
)
from kubetune.errors import UserError
from kubetune.export.gate import check_before_export
from kubetune.export.registry import REGISTRIES, register_and_report
from kubetune.fsutil import atomic_dir, file_lock


def _lock(registry: Path) -> Path:
    return registry.with_name(f".{registry.name}.lock")


def register(registry_file: Path, base: BaseModelRef, name: str, version: str, path: str) -> AdapterRegistry:
    """Add NAME@version (created for `base` when there is no registry yet); an alias without
    weights routes to its newest version. Refuses a registry of another base."""
    with file_lock(_lock(registry_file)):
        registry = read_registry(registry_file) if registry_file.exists() else AdapterRegistry(base=base)
        if (registry.base.name, registry.base.revision or None) != (base.name, base.revision or None):
            raise UserError(
                f"{registry_file} serves base {registry.base.name}@{registry.base.revision or 'default'}, "
                f"not {base.name}@{base.revision or 'default'}"
            )
        entry = registry.adapters.get(name)
        versions = {**(entry.versions if entry else {}), version: AdapterVersion(path=path)}
        adapter = RegisteredAdapter(versions=versions, weights=entry.weights if entry else {})
        updated = registry.model_copy(update={"adapters": {**registry.adapters, name: adapter}})
        write_registry(registry_file, updated)
        return updated


def unregister(registry_file: Path, name: str, version: str) -> AdapterRegistry | None:
    """Remove NAME@version (its files stay); its weight goes with it."""
    with file_lock(_lock(registry_file)):
        if not registry_file.exists():
            return None
        registry = read_registry(registry_file)
        entry = registry.adapters.get(name)
        if entry is None:
            return registry
        adapters = {n: a for n, a in registry.adapters.items() if n != name}
        versions = {v: p for v, p in entry.versions.items() if v != version}
        if versions:
            weights = {v: w for v, w in entry.weights.items() if v != version}
            # no weight left above 0: the newest version takes the alias again
            adapters[name] = RegisteredAdapter(versions=versions, weights=weights if any(weights.values()) else {})
        updated = registry.model_copy(update={"adapters": adapters})
        write_registry(registry_file, updated)
        return updated


def install(run_dir: Path, name: str, version: str, base: BaseModelRef, root: Path) -> Path:
    source = run_dir / "adapter"
    if not (source / "adapter_config.json").is_file():
        raise UserError(f"{source} holds no PEFT adapter (adapter_config.json): is {run_dir} a finished LoRA run?")
    target = Path(adapter_dir(name, version, str(root)))
    with atomic_dir(target) as tmp:
        shutil.copytree(source, tmp, dirs_exist_ok=True)
    register(root / REGISTRY_NAME, base, name, version, adapter_dir(name, version, str(root)))
    return target


def uninstall(name: str, version: str, root: Path, delete_files: bool) -> None:
    """Take NAME@version out of the registry (replicas that start later skip it); its files stay
    unless `delete_files` (the ModelServer's adapterStorage.retention: Delete)."""
    unregister(root / REGISTRY_NAME, name, version)
    if delete_files:
        shutil.rmtree(Path(adapter_dir(name, version, str(root))), ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kubetune.export.adapter_install")
    parser.add_argument("run_dir", type=Path, nargs="?")
    parser.add_argument("--name", required=True)
    parser.add_argument("--version", required=True)
    parser.add_argument("--base")
    parser.add_argument("--revision")
    parser.add_argument("--root", type=Path, default=Path(ROOT))
    parser.add_argument("--unregister", action="store_true")
    parser.add_argument("--delete-files", action="store_true")
    parser.add_argument("--gate", action="store_true", help="install only a run whose eval gate passed")
    parser.add_argument("--register", choices=REGISTRIES, help="then register it: mlflow or kubeflow")
    parser.add_argument("--registered-name")
    parser.add_argument("--registry-url")
    args = parser.parse_args(argv)
    try:
        if args.unregister:
            uninstall(args.name, args.version, args.root, args.delete_files)
            print(f"unregistered {args.name}@{args.version}")
            return 0
        if args.run_dir is None or args.base is None:
            raise UserError("give RUN_DIR and --base BASE (or --unregister)")
        if args.gate and not check_before_export(args.run_dir):
            print(f"not installed: {args.name}@{args.version}: the eval gate failed (docs/evaluation.md)")
            return 0
        base = BaseModelRef(name=args.base, revision=args.revision)
        target = install(args.run_dir, args.name, args.version, base, args.root)
        print(f"installed {args.name}@{args.version} at {target}")
        if args.register:
            name = args.registered_name or args.name
            print(register_and_report(args.register, args.run_dir, target, False, name, args.registry_url).line())
    except (UserError, OSError) as e:
        print(f"kubetune: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
