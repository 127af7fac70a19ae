"""Install a run's LoRA adapter into a shared server's adapter volume: the command of the
adapter-export Job the operator runs when a FineTune with `spec.serve.server` has trained.

    python -m kubetune.export.adapter_install RUN_DIR --name NAME --version vN --base BASE [--revision R]
    python -m kubetune.export.adapter_install --unregister --name NAME --version vN [--delete-files]

copies RUN_DIR/adapter (PEFT format, not merged) to /adapters/NAME/vN atomically, then registers
NAME@vN in /adapters/registry.json (`kubetune.contracts.adapters`), which every replica reads at
start. The operator then loads it into the running replicas. Exit 2 with one line on a problem.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

from kubetune.contracts.adapters import ROOT, BaseModelId, adapter_dir, register, unregister
from kubetune.fsutil import atomic_dir


def install(run_dir: Path, name: str, version: str, base: BaseModelId, root: Path) -> Path:
    source = run_dir / "adapter"
    if not (source / "adapter_config.json").is_file():
        raise ValueError(f"{source} holds no PEFT adapter (adapter_config.json): is {run_dir} a finished LoRA run?")
    target = Path(adapter_dir(name, version, str(root)))
    with atomic_dir(target) as tmp:
        shutil.copytree(source, tmp, dirs_exist_ok=True)
    register(root / "registry.json", base, name, version, adapter_dir(name, version))
    return target


def uninstall(name: str, version: str, root: Path, delete_files: bool) -> None:
    """Take NAME@version out of the registry (replicas that start later skip it); its files stay
    unless `delete_files` (the ModelServer's adapterStorage.retention: Delete)."""
    unregister(root / "registry.json", name, version)
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
    args = parser.parse_args(argv)
    if args.unregister:
        uninstall(args.name, args.version, args.root, args.delete_files)
        print(f"unregistered {args.name}@{args.version}")
        return 0
    if args.run_dir is None or args.base is None:
        print("kubetune: give RUN_DIR and --base BASE (or --unregister)", file=sys.stderr)
        return 2
    try:
        target = install(args.run_dir, args.name, args.version, BaseModelId(name=args.base, revision=args.revision),
                         args.root)  # fmt: skip
    except (ValueError, OSError) as e:
        print(f"kubetune: {e}", file=sys.stderr)
        return 2
    print(f"installed {args.name}@{args.version} at {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
