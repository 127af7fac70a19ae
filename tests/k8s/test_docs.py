"""The cluster guide (docs/cluster.md) works as written up to the cluster; docs/comm.md covers every key."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kubetune.recipe.loader import all_keys
from tests.kit.cli import run_cli_redirected
from tests.kit.paths import REPO

from .conftest import TOKEN

pytestmark = pytest.mark.process

GUIDE = REPO / "docs" / "cluster.md"
COMM = REPO / "docs" / "comm.md"


def offline_blocks(text: str) -> list[str]:
    """The ```bash blocks marked `<!-- offline -->`: everything a reader runs before a cluster is needed."""
    return re.findall(r"<!-- offline -->\s*```bash\n(.*?)```", text, re.S)


def test_the_guide_runs_as_written_until_a_cluster_is_needed(tmp_path):
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl is not installed (the guide uses `kubectl kustomize`)")
    blocks = offline_blocks(GUIDE.read_text())
    assert len(blocks) == 4
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}", HF_TOKEN=TOKEN)
    env.pop("KUBECONFIG", None)
    script = "set -euo pipefail\n" + "\n".join(blocks)
    result = subprocess.run(["bash", "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("---\napiVersion: v1\nkind: PersistentVolumeClaim")  # `render | head`: no Namespace
    assert (tmp_path / "manifests" / "kustomization.yaml").is_file()
    assert (tmp_path / "serve" / "kustomization.yaml").is_file()  # render-serve's block
    assert TOKEN not in result.stdout + result.stderr


RENDER_ERROR_BLOCK = re.compile(r"```console\n\$ kubetune (k8s render \S+[^\n]*)\n(kubetune: error: [^\n]*)\n```")


def test_the_guides_render_errors_are_what_render_prints():
    # each ```console block of `kubetune k8s render BUILTIN ...`: the error line shown is the one printed
    from kubetune.recipe.loader import builtin_recipes

    blocks = RENDER_ERROR_BLOCK.findall(GUIDE.read_text())
    runnable = [(cmd.split(), shown) for cmd, shown in blocks if cmd.split()[2] in builtin_recipes()]
    assert runnable, "the guide shows no render error of a builtin recipe"
    for args, shown in runnable:
        result = run_cli_redirected(*args)
        assert result.code == 2 and result.err.strip() == shown, (args, result.err)


def test_every_cluster_command_in_the_guide_exists():
    import typer.main

    from kubetune import cli

    commands = set(re.findall(r"kubetune k8s ([a-z][\w-]*)", GUIDE.read_text()))
    registered = set(typer.main.get_command(cli.k8s_app).commands)
    assert {"render", "render-serve", "submit", "status", "delete"} <= commands
    assert commands <= registered, commands - registered


def test_comm_doc_covers_every_key():
    text = COMM.read_text()
    leaves = [k for k in all_keys() if k.startswith("comm.") and k not in ("comm.nccl", "comm.hccl")]
    missing = [k for k in leaves if f"`{k}`" not in text]
    assert not missing, missing


def test_the_comm_example_is_a_valid_comm_section_and_renders_the_seed_table(tmp_path):
    # the example quotes the seed's NCCL table, `8M` included: it must load as written
    from kubetune.recipe.comm import comm_env
    from kubetune.recipe.loader import load_recipe

    (block,) = re.findall(r"```yaml\n(comm:.*?)```", COMM.read_text(), re.S)
    recipe = tmp_path / "comm.yaml"
    recipe.write_text(block)
    env = comm_env(load_recipe(str(recipe)).recipe.comm, "nvidia")
    assert (env["NCCL_ALGO"], env["NCCL_PROTO"], env["NCCL_BUFFSIZE"], env["NCCL_NSOCKS_PERTHREAD"]) == (
        "Tree",
        "Simple",
        "8388608",
        "4",
    )


def test_comm_doc_calls_nothing_the_seeds_it_cannot_source():
    text = " ".join(COMM.read_text().split())
    assert "issue 11" in text and "that setup's own documents are not in this repository" in text
    assert "Ring" not in text.split("## Every kind")[0]  # the old, unsourced "seed's table"
