"""Both seeds' workflows, run as README.md, docs/ and the shipped recipes' headers write them (issue 34, item 7).

Seed 002 (Intel's huggingface-llm chart on Xeon): the recipe's header commands; the cluster guide's job from
`my-job.yaml` through render, submit, status, logs, doctor and delete; the guide's console blocks of the seed's
recipes; the operator page's Helm installs of the chart's example and of the seed's own values file, and `recipe
from-helm-values`; serving. Seed 000 (a Llama-2-13B-class model on 8 nodes x 4 Gaudi2, tp 4 in a node, pp 8
across, a global batch of 2048): the recipe's header commands, the local launch's layout check, serving on
Gaudi, and the scheduler configuration the components page shows.

The commands are read out of the docs' code blocks and the recipes' headers, so a doc that drifts from the CLI
fails here. kubetune lines run through kubetune.cli.main against kmock's API server (conftest.py's `kube`), helm
lines through Helm's own engine (tests/charts/helm.py). What needs a real cluster is left out where it comes
up, naming the test that covers it: kubectl, `download`'s exec (test_exec_download.py), the pods' own start
(test_gated_token.py runs the gated model's pod against a Hub that refuses it), the operator's reconcile
(tests/operator/), kube-scheduler calling the extender (tests/cluster/test_extender_chain.py).
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import yaml

from tests.kit.paths import REPO

from .conftest import TOKEN

GUIDE = REPO / "docs" / "cluster.md"
OPERATOR = REPO / "docs" / "operator.md"
COMPONENTS = REPO / "docs" / "cluster-components.md"
FINETUNE_README = REPO / "charts" / "kubetune-finetune" / "README.md"
SEED_002 = "llama2-7b-medical-flashcards"
SEED_000 = "llama2-13b-gaudi-tp4-pp8"
GUIDE_JOB, GUIDE_NS = "llama2-flashcards", "fine-tuning"  # the guide's my-job.yaml


# ------------------------------------------------------------------ reading the commands out of the docs


def code_blocks(text: str) -> list[str]:
    """Every fenced block's body (any language, indented fences too), continuation lines joined."""
    return [body.replace("\\\n", " ") for body in re.findall(r"^ *```[a-z]*\n(.*?)^ *```", text, re.S | re.M)]


def shell_words(line: str) -> list[str]:
    """A command line as the shell splits it, without its comment, pipe or redirection."""
    words = shlex.split(line, comments=True)
    cut = next((i for i, w in enumerate(words) if w == "|" or w.startswith((">", "2>"))), len(words))
    return words[:cut]


def doc_commands(text: str, program: str) -> list[tuple[list[str], list[str]]]:
    """(words, the output shown under it) of each `program ...` line of the code blocks, in order; a console
    block's `$ ` prompt is dropped, and its output runs to the next prompt."""
    found: list[tuple[list[str], list[str]]] = []
    for block in code_blocks(text):
        shown: list[str] | None = None  # the output of this block's last prompt
        for line in block.splitlines():
            command = line.strip().removeprefix("$ ")
            if command.startswith(program + " "):
                shown = [] if line.startswith("$ ") else None
                found.append((shell_words(command), shown if shown is not None else []))
            elif shown is not None and line.startswith("kubetune: "):
                shown.append(line)
    return found


def header_commands(recipe: str) -> list[list[str]]:
    """The `#   kubetune ...` lines a shipped recipe opens with."""
    text = (REPO / "recipes" / f"{recipe}.yaml").read_text()
    return [shell_words(line) for line in re.findall(r"^#   (kubetune .*)$", text, re.M)]


def naming(commands: list[tuple[list[str], list[str]]], *names: str) -> list[tuple[list[str], list[str]]]:
    return [(words, shown) for words, shown in commands if any(n in words for n in names)]


def shown_lines_printed(shown: list[str], printed: str) -> None:
    """Each line the doc shows is printed (a shown line ending in `(...)` is a prefix of the printed one)."""
    lines = printed.splitlines()
    for line in shown:
        if line.endswith(" (...)"):
            assert any(p.startswith(line.removesuffix(" (...)")) for p in lines), (line, printed)
        else:
            assert line in lines, (line, printed)


def run(cli, words: list[str]):
    assert words[0] == "kubetune", words
    return cli(*words[1:])


def expected_code(shown: list[str]) -> int:
    return 2 if any(line.startswith("kubetune: error:") for line in shown) else 0


# ------------------------------------------------------------------ seed 002: the cluster guide's job


def guide_block(start: str) -> str:
    """The guide's code block whose body starts with `start`."""
    (block,) = [b for b in code_blocks(GUIDE.read_text()) if b.startswith(start)]
    return block


def write_guide_files(tmp_path: Path) -> None:
    """What the guide has the reader write: my-job.yaml (section 2's heredoc), the token file (section 3), and
    the minimal recipe its notes example describes (a base model and a dataset: seed 002's section 4.2)."""
    heredoc = re.search(r"cat > my-job.yaml <<'EOF'\n(.*?)^EOF$", GUIDE.read_text(), re.S | re.M)
    assert heredoc, "the guide no longer writes my-job.yaml"
    (tmp_path / "my-job.yaml").write_text(heredoc.group(1))
    (tmp_path / "hf-token").write_text(TOKEN + "\n")
    minimal = {
        "model": {"name_or_path": "meta-llama/Llama-2-7b-hf"},
        "data": {"train": "medalpaca/medical_meadow_medical_flashcards"},
    }
    (tmp_path / "minimal.yaml").write_text(yaml.safe_dump(minimal))


def cluster_runs_the_guides_job(kube) -> None:
    """What the Training Operator and the kubelet would have made of the submitted job by the time the reader
    looks (section 4): the job Running, its 4 pods on 4 nodes, rank 0's log with the line the guide shows."""
    client = kube.client()
    job = {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "metadata": {"name": GUIDE_JOB, "namespace": GUIDE_NS},
    }
    conditions = [{"type": "Created", "status": "True"}, {"type": "Running", "status": "True"}]
    client.patch({**job, "status": {"conditions": conditions}})
    pods = [("master", 0, "xeon-a"), ("worker", 0, "xeon-b"), ("worker", 1, "xeon-c"), ("worker", 2, "xeon-d")]
    for kind, index, node in pods:
        labels = {
            "app.kubernetes.io/instance": GUIDE_JOB,
            "app.kubernetes.io/component": "trainer",
            "training.kubeflow.org/replica-type": kind,
            "training.kubeflow.org/replica-index": str(index),
        }
        running = {"name": "pytorch", "restartCount": 0, "ready": True, "state": {"running": {}}}
        client.create(
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": f"{GUIDE_JOB}-{kind}-{index}", "namespace": GUIDE_NS, "labels": labels},
                "spec": {"containers": [{"name": "pytorch", "image": "img"}], "nodeName": node},
                "status": {"phase": "Running", "containerStatuses": [running]},
            }
        )
    pvc = {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": f"{GUIDE_JOB}-data", "namespace": GUIDE_NS},
    }
    client.patch({**pvc, "status": {"phase": "Bound"}})
    kube.script_log(f"{GUIDE_JOB}-master-0", guide_block("{'loss'"))


def test_seed_002_the_guides_job_from_render_to_delete(cli, kube, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    kube.script_namespace(GUIDE_NS)
    write_guide_files(tmp_path)
    steps = naming(doc_commands(GUIDE.read_text(), "kubetune"), "my-job.yaml", "minimal.yaml", GUIDE_JOB)
    # section 2's first command without a token: the gated model is refused in one line naming both sources
    refused = run(cli, steps[0][0])
    assert refused.code == 2 and refused.err.count("\n") == 1, refused.err
    assert "--hf-token-file FILE (or $HF_TOKEN)" in refused.err
    monkeypatch.setenv("HF_TOKEN", TOKEN)  # as section 2's comment says, from here on
    assert [w[2] for w, _ in steps] == [
        "render", "render", "render", "render", "submit", "status", "logs", "doctor", "download", "delete", "delete"
    ]  # fmt: skip
    printed = {}
    for words, shown in steps:
        if words[2] == "download":
            continue  # exec into the data pod: test_exec_download.py
        if words[2] == "status":
            cluster_runs_the_guides_job(kube)
        result = run(cli, words)
        assert result.code == expected_code(shown), (words, result.err)
        shown_lines_printed(shown, result.err)
        printed[" ".join(words[2:4]) + (" --purge" if "--purge" in words else "")] = result
    assert (tmp_path / "manifests" / "kustomization.yaml").is_file()
    assert "created PyTorchJob fine-tuning/llama2-flashcards" in printed["submit my-job.yaml"].out
    assert (GUIDE_NS, f"{GUIDE_JOB}-hf-token") not in kube.objects("v1/secrets")  # deleted with the job
    # section 4 as the guide shows it: the status block, the log's lines, no finding
    assert printed[f"status {GUIDE_JOB}"].out.splitlines() == guide_block("PyTorchJob ").splitlines()
    assert printed[f"logs {GUIDE_JOB}"].out == guide_block("{'loss'")
    assert "no problems found" in printed[f"doctor {GUIDE_JOB}"].out
    assert kube.objects("kubeflow.org/v1/pytorchjobs") == {} and kube.objects("v1/persistentvolumeclaims") == {}


def without_token(words: list[str]) -> list[str]:
    i = words.index("--hf-token-file")
    return words[:i] + words[i + 2 :]


def pod_containers(job: dict) -> dict[str, tuple[int, dict]]:
    return {
        kind: (spec["replicas"], spec["template"]["spec"]["containers"][0])
        for kind, spec in job["spec"]["pytorchReplicaSpecs"].items()
    }


# ------------------------------------------------------------------ seed 002: the shipped recipe


def test_seed_002_the_recipes_header_and_the_guides_console(cli, kube, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "hf-token").write_text(TOKEN + "\n")
    render, submit, train = header_commands(SEED_002)
    assert train == ["kubetune", "train", SEED_002]  # one machine: downloads the 7B model, not run here
    # a reader who skips the header's "Needs HF_TOKEN": refused in one line, nothing sent
    for words in (render, submit):
        refused = run(cli, without_token(words))
        assert refused.code == 2 and "--hf-token-file" in refused.err and "hfTokenSecretRef" in refused.err
    assert kube.objects("kubeflow.org/v1/pytorchjobs") == {}
    checked = run(cli, render)
    assert checked.code == 0, checked.err
    assert "kubetune: global batch: 128 rows per optimizer step" in checked.err and "all valid" in checked.err
    submitted = run(cli, submit)
    assert submitted.code == 0, submitted.err
    job = kube.objects("kubeflow.org/v1/pytorchjobs")[("kubetune", SEED_002)]
    ((kind, (replicas, container)),) = pod_containers(job).items()
    assert (kind, replicas, job["spec"]["elasticPolicy"]["rdzvBackend"]) == ("Worker", 4, "c10d")  # the seed's
    token = next(e["valueFrom"]["secretKeyRef"] for e in container["env"] if e["name"] == "HF_TOKEN")
    assert token == {"name": f"{SEED_002}-hf-token", "key": "HF_TOKEN", "optional": False}  # pods wait for it
    # submitting again (the guide, section 3): with the token again; resumable keys only
    assert run(cli, [*without_token(submit), "train.epochs=4"]).code == 2
    assert run(cli, [*submit, "train.epochs=4"]).code == 0
    changed = run(cli, [*submit, "train.lr=1e-4"])
    assert changed.code == 2 and "train.lr (2e-05 -> 0.0001)" in changed.err
    # every render of this recipe in the guide runs and prints what it shows (memory, quota, Kueue, DRA; the
    # Kueue doctor's Workload: test_kueue.py), with the token in the environment as the guide's section 2 has it
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    blocks = [
        (w, shown) for w, shown in naming(doc_commands(GUIDE.read_text(), "kubetune"), SEED_002) if w[2] == "render"
    ]
    assert len(blocks) == 4, blocks
    for words, shown in blocks:
        result = run(cli, words)
        assert result.code == expected_code(shown), (words, result.err)
        shown_lines_printed(shown, result.err)


def served(cli, recipe: str, profile: str) -> tuple[dict, str]:
    """The guide's render-serve command (section 8) for this recipe and profile: the Deployment's container and
    stderr."""
    ((words, _),) = [(w, s) for w, s in doc_commands(GUIDE.read_text(), "kubetune") if w[2] == "render-serve"]
    words = [recipe if w == words[3] else profile if w == words[words.index("--profile") + 1] else w for w in words]
    words = words[: words.index("-o")] if "-o" in words else words  # printed, not written
    result = run(cli, words)
    assert result.code == 0, result.err
    (deployment,) = [d for d in yaml.safe_load_all(result.out) if d and d["kind"] == "Deployment"]
    return deployment["spec"]["template"]["spec"]["containers"][0], result.err


def token_secret(container: dict) -> str:
    return next(e["valueFrom"]["secretKeyRef"]["name"] for e in container["env"] if e["name"] == "HF_TOKEN")


def test_both_seeds_served_as_the_guide_says(cli):
    container, _ = served(cli, SEED_002, "cpu")
    assert container["command"][:2] == ["kubetune", "serve"] and "native" in container["command"]
    assert token_secret(container) == f"{SEED_002}-hf-token"  # the training job's Secret, not a second one
    container, err = served(cli, SEED_000, "gaudi")  # the pod's 4 cards: vLLM, not the CPU engine
    command = container.get("command", []) + container.get("args", [])
    assert "vllm.entrypoints.openai.api_server" in command
    assert command[command.index("--tensor-parallel-size") + 1] == "4"
    assert token_secret(container) == f"{SEED_000}-hf-token" and "native" not in err


# ------------------------------------------------------------------ seed 002: Helm and the operator


def helm_installs() -> list[list[str]]:
    """Every `helm install` of the operator page and the finetune chart's README, as written."""
    found = doc_commands(OPERATOR.read_text(), "helm") + doc_commands(FINETUNE_README.read_text(), "helm")
    return [words for words, _ in found if words[1] == "install"]


def helm_install(words: list[str], values: dict | None = None) -> dict[str, str]:
    """`helm install NAME CHART -n NS [-f FILE]` through Helm's engine: {template: text}, NOTES.txt included."""
    import helm_python

    from ..charts.helm import chart

    if values is None:
        values = (
            helm_python.values_from_yaml((REPO / words[words.index("-f") + 1]).read_text()) if "-f" in words else {}
        )
    return chart(REPO / words[3]).render(values, name=words[2], namespace=words[words.index("-n") + 1])


def manifests(rendered: dict[str, str]) -> list[dict]:
    """The objects of a render, read as Helm reads them (NOTES.txt is text for the user)."""
    from ..charts.helm import parse_manifests

    return [o for path, text in rendered.items() if not path.endswith("NOTES.txt") for o in parse_manifests(text)]


def the_finetune(rendered: dict[str, str]) -> dict:
    (obj,) = [o for o in manifests(rendered) if o["kind"] == "FineTune"]
    return obj


def operator_recipe(obj: dict):
    """What the operator makes of the FineTune (actions.spec_recipe: the CLI's loader, the render checks, the
    gated model's token), RecipeError with the operator's `Valid` line otherwise."""
    from kubetune.operator import actions, plan
    from kubetune.operator.crd import check_finetune

    assert check_finetune(obj) == []  # the API server accepts it
    return actions.spec_recipe(None, obj, plan.FineTuneSpec.from_dict(obj["spec"]))  # inline recipe: no client call


def test_seed_002_through_helm_and_the_operator(cli, tmp_path, monkeypatch):
    from kubetune.errors import RecipeError
    from kubetune.k8s.render import job_name

    installs = helm_installs()
    assert [w[2] for w in installs] == ["kubetune-operator", "medical", "medical", "medical", "medical"]
    operator = {o["kind"] for o in manifests(helm_install(installs[0]))}
    assert {"Deployment", "ClusterRole", "ServiceAccount"} <= operator
    for words in installs[1:]:  # the chart's example and seed 002's own values file
        rendered = helm_install(words)
        recipe = operator_recipe(the_finetune(rendered))
        assert job_name(recipe) == "medical" and recipe.k8s.replicas == 4, words
        assert "kubectl get finetune medical -n fine-tuning -w" in rendered["kubetune-finetune/templates/NOTES.txt"]
    # `recipe from-helm-values` of the seed's file: the job the release runs, ready for `k8s render`
    monkeypatch.chdir(tmp_path)
    (tmp_path / "hf-token").write_text(TOKEN + "\n")
    commands = [w for w, _ in doc_commands(OPERATOR.read_text() + FINETUNE_README.read_text(), "kubetune")]
    (from_values,) = {tuple(w) for w in commands if w[1:3] == ["recipe", "from-helm-values"]}
    printed = run(cli, [str(REPO / w) if w.endswith(".yaml") else w for w in from_values])
    assert printed.code == 0, printed.err
    assert yaml.safe_load(printed.out)["output_dir"] == "/data/runs/medical"
    (tmp_path / "medical.yaml").write_text(printed.out)
    checked = run(cli, ["kubetune", "k8s", "render", "medical.yaml", "--check", "--hf-token-file", "hf-token"])
    assert checked.code == 0, checked.err
    # seed 002's section 4.2 values (a base model and a dataset, no token): installs, NOTES list the seed's
    # keys left unset, and the operator refuses the gated model naming spec.hfTokenSecretRef until it has one
    snippet = {
        "distributed": {
            "modelNameOrPath": "meta-llama/Llama-2-7b-hf",
            "train": {"datasetName": "medalpaca/medical_meadow_medical_flashcards"},
        }
    }
    rendered = helm_install(installs[1], snippet)
    assert (
        "distributed.workers -> recipe.k8s.replicas = 2 (Intel's chart: 4)"
        in rendered["kubetune-finetune/templates/NOTES.txt"]
    )
    with pytest.raises(RecipeError, match=r"spec\.hfTokenSecretRef"):
        operator_recipe(the_finetune(rendered))
    recipe = operator_recipe(
        the_finetune(helm_install(installs[1], {**snippet, "hfTokenSecretRef": {"name": "hf-token"}}))
    )
    assert recipe.data.template == "auto"  # Alpaca's prompt for the base model (render's note says so)


# ------------------------------------------------------------------ seed 000


def test_seed_000_the_recipes_header(cli, kube, tmp_path, monkeypatch):
    from kubetune.training.launch import precheck

    monkeypatch.chdir(tmp_path)
    (tmp_path / "hf-token").write_text(TOKEN + "\n")
    render, submit, train = header_commands(SEED_000)
    assert run(cli, without_token(render)).code == 2  # gated: the header's "Needs HF_TOKEN"
    checked = run(cli, render)
    assert checked.code == 0, checked.err
    assert (
        "kubetune: global batch: 2,048 rows per optimizer step (train.micro_batch_size=4 x 512 micro-batches x 1 "
        "data-parallel replica(s), train.global_batch_size=2048), up to 1,048,576 tokens per step" in checked.err
    )
    assert run(cli, submit).code == 0
    job = kube.objects("kubeflow.org/v1/pytorchjobs")[("kubetune", SEED_000)]
    pods = pod_containers(job)
    assert sum(replicas for replicas, _ in pods.values()) == 8  # 8 nodes
    assert {c["resources"]["limits"]["habana.ai/gaudi"] for _, c in pods.values()} == {"4"}  # x 4 Gaudi2
    assert job["spec"]["nprocPerNode"] == "4"
    # the header's one-host command: the launcher's layout check passes offline (the model's shape is known
    # without its config: a host without the Hub, or without the token yet, is told about the layout, not a
    # traceback), before torchrun starts a worker
    nproc = int(train[train.index("--nproc-per-node") + 1])
    overrides = [w for w in train if "=" in w]
    precheck(train[2], overrides, world_size=nproc, nproc_per_node=nproc)
    # the header's other layout: the seed's accumulation of 4 (gpipe), 2048 rows in 4 micro-batches of 512
    header = (REPO / "recipes" / f"{SEED_000}.yaml").read_text()
    (seed_accumulation,) = re.findall(r"`(train\.micro_batch_size=\d+ [^`]+)`", header)
    gpipe = run(cli, [*render, *seed_accumulation.split()])
    assert gpipe.code == 0 and "train.micro_batch_size=512 x 4 micro-batches" in gpipe.err, gpipe.err
    # the guide's console block of this recipe: a tp that crosses a pod, refused as shown
    ((words, shown),) = naming(doc_commands(GUIDE.read_text(), "kubetune"), SEED_000)
    refused = run(cli, words)
    assert refused.code == expected_code(shown) == 2 and refused.err.splitlines() == shown


def test_the_launchers_layout_check_of_an_unknown_hub_model_offline_is_one_line():
    from kubetune.errors import ModelError
    from kubetune.training.launch import precheck

    # HF_HUB_OFFLINE=1 (tests/conftest.py): the config cannot be fetched, as on a host without the Hub
    with pytest.raises(
        ModelError, match=r"^model\.name_or_path=example-org/no-such-model: cannot load the model's config"
    ):
        precheck(
            None, ["model.name_or_path=example-org/no-such-model", "parallel.tp=2"], world_size=2, nproc_per_node=2
        )


def test_seed_000_the_scheduler_configuration_is_the_one_the_components_page_shows(cli):
    # kube-scheduler reads the extender's answers by name only with nodeCacheCapable: true, which needs the
    # extender's own watch (--watch-pods); the chain itself: tests/cluster/test_extender_chain.py
    text = COMPONENTS.read_text()
    (words,) = [w for w, _ in doc_commands(text, "kubetune") if w[2] == "render-components" and "--namespace" in w]
    result = run(cli, words)
    assert result.code == 0, result.err
    objs = {(o["kind"], o["metadata"]["name"]): o for o in yaml.safe_load_all(result.out) if o}
    config = yaml.safe_load(objs[("ConfigMap", "kubetune-scheduler-config")]["data"]["kube-scheduler-config.yaml"])
    (shown,) = [yaml.safe_load(b) for b in code_blocks(text) if "kind: KubeSchedulerConfiguration" in b]
    assert config == shown and shown["extenders"][0]["nodeCacheCapable"] is True
    (extender,) = objs[("Deployment", "kubetune-scheduler-extender")]["spec"]["template"]["spec"]["containers"]
    assert "--watch-pods" in extender["args"]
