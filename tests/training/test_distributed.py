"""One recipe on several real processes (gloo on loopback): every launcher, DDP equivalence,
rescaled resume, and a worker killed under the elastic agent."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import psutil
import pytest

from kubetune.netutil import free_port
from tests.kit.cli import run_cli_in_process
from tests.kit.paths import REPO
from tests.kit.processes import base_env, finish, pod_env, start_kubetune, wait_for_checkpoint

from ..conftest import for_processes, resumed_here, tiny_recipe, write_qa_file

pytestmark = pytest.mark.multiproc


def losses(run: Path) -> list[float]:
    return [json.loads(ln)["loss"] for ln in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture
def dist_overrides(tiny_overrides):
    return for_processes(tiny_overrides)


# What every layout below is compared with: one process, grad_accum 2 (a step's 4 rows),
# sample answers after training.
ONE_PROCESS = ("train.grad_accum=2", "eval.generate=1")


class Run(NamedTuple):
    dir: Path
    output: str  # what the process printed


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, tiny_model_dir):
    """`one_process(*extra)`: one `kubetune train` process of the tiny recipe with
    ONE_PROCESS and `extra`, trained once per module for every test that compares a layout
    with that same run."""
    root = tmp_path_factory.mktemp("one-process")
    recipe = for_processes(tiny_recipe(tiny_model_dir, write_qa_file(root / "qa.jsonl"), root / "cache"))
    runs: dict[tuple[str, ...], Run] = {}

    def run(*extra: str) -> Run:
        if extra not in runs:
            out = root / f"run-{len(runs)}"
            runs[extra] = Run(
                out, finish(start_kubetune(["train", *recipe, *ONE_PROCESS, *extra, f"output_dir={out}"]))
            )
        return runs[extra]

    return run


def test_two_processes_equal_one_with_grad_accum_two(tmp_path, dist_overrides, one_process):
    one = one_process()
    two = finish(
        start_kubetune(
            ["train", "--nproc-per-node", "2", *dist_overrides, "train.grad_accum=1", f"output_dir={tmp_path / 'two'}"]
        )
    )
    assert "2 process(es)" in two and "1 process(es)" in one.output
    a, b = losses(one.dir), losses(tmp_path / "two")
    assert len(a) == len(b) == 4
    for x, y in zip(a, b):
        assert abs(x - y) < 1e-4 * max(1.0, abs(x)), (a, b)
    sa = json.loads((one.dir / "summary.json").read_text())
    sb = json.loads((tmp_path / "two" / "summary.json").read_text())
    assert sa["train_tokens"] == sb["train_tokens"]
    assert abs(sa["eval_loss_after"] - sb["eval_loss_after"]) < 1e-4 * abs(sa["eval_loss_after"])


def test_nproc_per_node_auto_is_one_process_per_core(tmp_path, dist_overrides, capfd):
    """`--nproc-per-node auto` reaches the launcher as local_processes' count (a layout made
    for one process more is refused naming that count), and a bad value is one line; both
    through kubetune.cli.main in this process (test_impossible_layouts_are_one_line's real
    process shows the refusal's one line)."""
    from kubetune.training.launch import local_processes

    n = local_processes("auto")
    assert 1 <= n <= os.cpu_count()
    out = f"output_dir={tmp_path / 'auto'}"
    refused = run_cli_in_process(
        ["train", "--nproc-per-node", "auto", *dist_overrides, f"parallel.fsdp={n + 1}", out], capfd
    )
    assert refused.returncode == 2 and f"but {n} process(es) run" in refused.stderr, refused.stderr
    bad = run_cli_in_process(
        ["train", "--nproc-per-node", "two", *dist_overrides, f"output_dir={tmp_path / 'bad'}"], capfd
    )
    text = bad.stdout + bad.stderr
    assert bad.returncode == 2 and "--nproc-per-node two" in text and "Traceback" not in text, text


@pytest.mark.slow  # CI: auto's count is checked above; launching a count is --nproc-per-node N's (DDP test)
def test_nproc_per_node_auto_launches_one_process_per_core(tmp_path, dist_overrides):
    from kubetune.training.launch import local_processes

    n = local_processes("auto")
    args = [
        "train",
        "--nproc-per-node",
        "auto",
        *dist_overrides,
        "train.max_steps=2",
        f"output_dir={tmp_path / 'auto'}",
    ]
    assert f"{n} process(es)" in finish(start_kubetune(args))


@pytest.mark.slow  # CI: the two-host network-namespace test runs the same PyTorchJob contract
def test_pytorchjob_contract_one_process_per_pod(tmp_path, dist_overrides):
    """What the Kubeflow training operator injects: MASTER_ADDR/PORT, WORLD_SIZE, RANK."""
    port = str(free_port())
    run = tmp_path / "job"
    procs = [
        start_kubetune(
            ["train", *dist_overrides, f"output_dir={run}"],
            env=base_env(
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=port,
                WORLD_SIZE="2",
                RANK=str(r),
                PET_NNODES="2",
                PET_NODE_RANK=str(r),
                PYTHONUNBUFFERED="1",
            ),
        )
        for r in range(2)
    ]
    outs = [finish(p) for p in procs]
    assert "2 process(es)" in outs[0]
    assert json.loads((run / "summary.json").read_text())["steps"] == 4
    assert (run / "checkpoints" / "step-4" / "meta.json").is_file()


def test_trainjob_contract_starts_torchrun_from_pet_variables(tmp_path, dist_overrides):
    """Trainer v2 sets only PET_NNODES/NODE_RANK/MASTER_ADDR/MASTER_PORT/NPROC_PER_NODE."""
    port = str(free_port())
    run = tmp_path / "trainjob"
    procs = [
        start_kubetune(
            ["train", *dist_overrides, f"output_dir={run}"],
            env=base_env(
                PET_NNODES="2",
                PET_NODE_RANK=str(r),
                PET_MASTER_ADDR="127.0.0.1",
                PET_MASTER_PORT=port,
                PET_NPROC_PER_NODE="1",
            ),
        )
        for r in range(2)
    ]
    outs = [finish(p) for p in procs]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 4
    # each node's first process prints its own progress (the pod a user follows may not be rank 0)
    for rank, out in enumerate(outs):
        assert "| 4/4 [" in out and f", rank={rank}]" in out, out[-2000:]
        assert "{'loss': " in out and "{'train_runtime': " in out


@pytest.mark.slow  # a second two-node run (14 s on CI's cores); the TrainJob contract above shows every node printing
def test_elastic_pytorchjob_contract_c10d_workers_only(tmp_path, dist_overrides):
    """Seed 002's layout: Workers only, which the operator gives an elasticPolicy's variables
    (PET_NNODES min:max, PET_RDZV_BACKEND=c10d, PET_RDZV_ENDPOINT <job>-worker-0:port) and no RANK."""
    endpoint = f"127.0.0.1:{free_port()}"
    run = tmp_path / "elastic"
    env = {"PET_NNODES": "2:2", "PET_RDZV_BACKEND": "c10d", "PET_RDZV_ENDPOINT": endpoint, "PET_RDZV_ID": "job"}
    env |= {"PET_NPROC_PER_NODE": "1", "PET_MAX_RESTARTS": "3"}
    procs = [start_kubetune(["train", *dist_overrides, f"output_dir={run}"], env=base_env(**env)) for _ in range(2)]
    outs = [finish(p) for p in procs]
    assert json.loads((run / "summary.json").read_text())["steps"] == 4
    ranks = {
        int(line.rsplit("rank=", 1)[1].rstrip("]")) for out in outs for line in out.splitlines() if "| 4/4 [" in line
    }
    assert ranks == {0, 1}  # c10d chose who is rank 0; both pods' logs show training


@pytest.mark.slow
def test_rescaled_resume_two_one_two(tmp_path, dist_overrides):
    run = tmp_path / "elastic"
    common = [o for o in dist_overrides if not o.startswith("train.max_steps")] + [
        "train.save_every=2",
        f"output_dir={run}",
    ]
    finish(start_kubetune(["train", "--nproc-per-node", "2", *common, "train.max_steps=4"]))
    out1 = finish(start_kubetune(["train", *common, "train.max_steps=6"]))
    assert "resumed from" in out1 and "step-4" in out1
    out2 = finish(start_kubetune(["train", "--nproc-per-node", "2", *common, "train.max_steps=8"]))
    assert "step-6" in out2
    steps = [json.loads(ln)["step"] for ln in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 9))


@pytest.mark.slow  # CI's time: a further combination of what the default suite covers
def test_killed_worker_is_restarted_and_resumes(tmp_path, dist_overrides):
    run = tmp_path / "restart"
    args = [o for o in dist_overrides if not o.startswith("train.max_steps")] + [
        "train.max_steps=12",
        "train.save_every=2",
        f"output_dir={run}",
    ]
    agent = start_kubetune(["train", "--nproc-per-node", "2", "--max-restarts", "2", *args])
    wait_for_checkpoint(run, 4, agent)
    workers = [c for c in psutil.Process(agent.pid).children(recursive=True) if "kubetune" in " ".join(c.cmdline())]
    assert workers, "no worker processes found"
    os.kill(workers[-1].pid, signal.SIGKILL)
    out = finish(agent, timeout=300)
    assert "resumed from" in out
    assert json.loads((run / "summary.json").read_text())["steps"] == 12


@pytest.mark.slow  # CI's time: a further combination of what the default suite covers
def test_fsdp2_equals_one_process_and_exports_a_gathered_adapter(tmp_path, dist_overrides, one_process, caplog):
    from safetensors.torch import load_file

    one = one_process().dir
    fsdp = tmp_path / "fsdp"
    out = finish(
        start_kubetune(
            [
                "train",
                "--nproc-per-node",
                "2",
                *dist_overrides,
                "train.grad_accum=1",
                "parallel.fsdp=2",
                f"output_dir={fsdp}",
            ]
        )
    )
    assert "2 process(es)" in out
    a, b = losses(one), losses(fsdp)
    for x, y in zip(a, b):
        assert abs(x - y) < 1e-4 * max(1.0, abs(x)), (a, b)
    ad_one = load_file(one / "adapter" / "adapter_model.safetensors")
    ad_fsdp = load_file(fsdp / "adapter" / "adapter_model.safetensors")
    assert ad_one.keys() == ad_fsdp.keys()
    for k in ad_one:  # full, unsharded tensors with the same values
        assert ad_one[k].shape == ad_fsdp[k].shape
        assert (ad_one[k] - ad_fsdp[k]).abs().max() < 1e-3
    # a sharded checkpoint resumes in one process (this one)
    more = [o for o in dist_overrides if "max_steps" not in o]
    resumed_here([*more, "train.max_steps=6", "train.grad_accum=2", f"output_dir={fsdp}"], caplog)


def assert_same_run(a: Path, b: Path, rel: float = 1e-4) -> None:
    """Same loss trajectory, tokens and final eval loss, and the same adapter weights."""
    from safetensors.torch import load_file

    la, lb = losses(a), losses(b)
    assert len(la) == len(lb) and la, (la, lb)
    for x, y in zip(la, lb):
        assert abs(x - y) < rel * max(1.0, abs(x)), (la, lb)
    sa, sb = (json.loads((r / "summary.json").read_text()) for r in (a, b))
    assert sa["train_tokens"] == sb["train_tokens"]
    assert abs(sa["eval_loss_after"] - sb["eval_loss_after"]) < rel * abs(sa["eval_loss_after"])
    # greedy answers after training: generated by the sharded ranks in lockstep (tp) or by
    # rank 0 from every stage's weights (pp); the same weights give the same tokens
    assert [x["answer"] for x in sa["samples"]] == [x["answer"] for x in sb["samples"]]
    if (a / "adapter").is_dir():
        wa, wb = (load_file(r / "adapter" / "adapter_model.safetensors") for r in (a, b))
        assert wa.keys() == wb.keys() and wa
        for k in wa:
            assert wa[k].shape == wb[k].shape and (wa[k] - wb[k]).abs().max() < 1e-4, k


@pytest.mark.parametrize(
    ("method", "extra"),
    [pytest.param(m, e, marks=pytest.mark.slow) for m, e in (("full", []), ("lora", ["train.compile=true"]))],
    ids=["full", "lora-compile"],
)
def test_tensor_parallel_equals_one_process(tmp_path, dist_overrides, one_process, method, extra):
    """DTensor TP over 2 ranks (q/k/v/gate/up by output, o/down by input; LoRA adapters
    follow their base layer) trains exactly like one process: full fine-tune, and LoRA with
    train.compile (which then compiles the norms only; `slow`, as is tp2xpp2,
    which covers LoRA under TP)."""
    one, tp = one_process(f"finetune.method={method}").dir, tmp_path / f"tp-{method}"
    common = [*dist_overrides, f"finetune.method={method}", *ONE_PROCESS]
    out = finish(
        start_kubetune(["train", "--nproc-per-node", "2", *common, *extra, "parallel.tp=2", f"output_dir={tp}"])
    )
    assert "tp 2" in out
    assert_same_run(one, tp)
    if method == "full":  # the exported full model is whole (gathered from the slices) and loads
        from transformers import AutoModelForCausalLM

        assert AutoModelForCausalLM.from_pretrained(tp / "model").config.num_hidden_layers == 2


PP_COMMON = [*ONE_PROCESS, "train.save_every=2"]


@pytest.mark.slow  # CI's time: a further combination of what the default suite covers
def test_pipeline_parallel_equals_one_process_and_reshards(tmp_path, dist_overrides, one_process, caplog):
    """2 GPipe stages over the step's micro-batches equal one process; the pipeline's
    checkpoint then resumes in one process, step-exact."""
    one, pp = one_process().dir, tmp_path / "pp"
    common = [*dist_overrides, *PP_COMMON]
    out = finish(start_kubetune(["train", "--nproc-per-node", "2", *common, "parallel.pp=2", f"output_dir={pp}"]))
    assert "pp 2" in out
    assert_same_run(one, pp)
    assert_resumes_like(one, pp / "checkpoints" / "step-2", tmp_path / "from-pp-single", [], [], common, caplog)


@pytest.mark.slow  # the schedule and the reshard CI leaves to the GPipe test above
def test_pipeline_1f1b_equals_one_process_and_reshards_to_tensor_parallel(tmp_path, dist_overrides, one_process):
    """The 1F1B schedule (other order, same math) equals one process, and its checkpoint
    resumes under tensor parallelism step-exact."""
    one, f1b = one_process().dir, tmp_path / "1f1b"
    common = [*dist_overrides, *PP_COMMON]
    pipeline = ["--nproc-per-node", "2", *common, "parallel.pp=2", "parallel.pp_schedule=1f1b"]
    finish(start_kubetune(["train", *pipeline, f"output_dir={f1b}"]))
    assert_same_run(one, f1b)
    tp = (["--nproc-per-node", "2"], ["parallel.tp=2"])
    assert_resumes_like(one, f1b / "checkpoints" / "step-2", tmp_path / "from-pp-tp", *tp, common, None)


def assert_resumes_like(one: Path, ckpt: Path, run: Path, launch: list, layout: list, common: list, caplog) -> None:
    """Resuming `ckpt` (step 2) under `launch`/`layout` gives one process's steps 3 and 4
    (no `launch`: in this process)."""
    assert (ckpt / "meta.json").is_file()
    resume = [*common, *layout, f"train.resume={ckpt}", f"output_dir={run}"]
    if launch:
        assert "resumed from" in finish(start_kubetune(["train", *launch, *resume]))
    else:
        resumed_here(resume, caplog)
    steps = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in steps] == [3, 4]
    assert [r["loss"] for r in steps] == pytest.approx(losses(one)[2:], rel=1e-4)


@pytest.mark.parametrize(
    ("layout", "same_as"),
    [
        pytest.param(["parallel.tp=2"], "ddp", marks=pytest.mark.slow),  # tp (full) and tp2xpp2 cover it
        # slow: four processes on CI's two cores; tp (full) and pp (GPipe) each run in CI alone
        pytest.param(["parallel.tp=2", "parallel.pp=2"], "one", marks=pytest.mark.slow),
        pytest.param(["parallel.fsdp=2", "parallel.tp=2"], "ddp", marks=pytest.mark.slow),
        pytest.param(["parallel.pp=2"], "ddp", marks=pytest.mark.slow),
    ],
    ids=["dp2xtp2", "tp2xpp2", "fsdp2xtp2", "dp2xpp2"],
)
def test_four_processes_in_two_dimensions(tmp_path_factory, dist_overrides, layout, same_as):
    """dp 2 x tp 2, fsdp 2 x tp 2 and dp 2 x pp 2 train like 2-process DDP; tp 2 x pp 2
    like one process."""
    common = [*dist_overrides, "train.grad_accum=2", "train.max_steps=3"]
    reference = tmp_path_factory.mktemp(same_as)
    if same_as == "ddp":
        finish(start_kubetune(["train", "--nproc-per-node", "2", *common, f"output_dir={reference}"]))
    else:
        finish(start_kubetune(["train", *common, f"output_dir={reference}"]))
    run = tmp_path_factory.mktemp("-".join(layout))
    finish(start_kubetune(["train", "--nproc-per-node", "4", *common, *layout, f"output_dir={run}"]))
    assert_same_run(reference, run)


IMPOSSIBLE_LAYOUTS = (
    (["parallel.fsdp=3"], "dp x fsdp x tp x pp"),
    (["parallel.tp=2", "model.name_or_path=smollm2-135m-instruct"], "9 attention heads"),
    (["parallel.pp=2", "finetune.method=full"], "ties its input embedding"),
    (["parallel.pp=2", "parallel.fsdp=2", "parallel.dp=1"], "parallel.fsdp=1"),
    (["parallel.pp=2", "parallel.pp_schedule=1f1b", "train.grad_accum=1"], "train.grad_accum>=2"),
)


def test_impossible_layouts_are_one_line(tmp_path, dist_overrides):
    """`kubetune train --nproc-per-node 2` refuses each layout in its launcher (`precheck`),
    with one line, before any worker starts: the first as a real process (exit 2, one line,
    no traceback), every one through the very function the launcher calls."""
    from kubetune.errors import UserError
    from kubetune.training.launch import precheck

    out_dir = tmp_path / "x"
    (first, words), *_ = IMPOSSIBLE_LAYOUTS
    proc = start_kubetune(["train", "--nproc-per-node", "2", *dist_overrides, *first, f"output_dir={out_dir}"])
    out, _ = proc.communicate(timeout=180)
    assert proc.returncode == 2 and words in out, out[-2000:]
    assert "Traceback" not in out and len([ln for ln in out.splitlines() if ln.strip()]) == 1, out
    for bad, words in IMPOSSIBLE_LAYOUTS:
        with pytest.raises(UserError) as refused:
            precheck(None, [*dist_overrides, *bad, f"output_dir={out_dir}"], world_size=2, nproc_per_node=2)
        assert len(refused.value.problems) == 1 and words in refused.value.problems[0], refused.value.problems
        assert "\n" not in refused.value.problems[0]
    assert not out_dir.exists() or not any(out_dir.iterdir())


def test_two_hosts_in_network_namespaces_pytorchjob_contract(tmp_path, dist_overrides, two_hosts):
    """Each 'node' only sees its own veth: rank 1 reaches the master at host 0's address."""
    master_ip = two_hosts[0][1]
    run = tmp_path / "netns"
    procs = []
    for rank, (ns, _ip_addr, ifname) in enumerate(two_hosts):
        env = base_env(
            MASTER_ADDR=master_ip,
            MASTER_PORT="29512",
            WORLD_SIZE="2",
            RANK=str(rank),
            GLOO_SOCKET_IFNAME=ifname,
            PYTHONUNBUFFERED="1",
        )
        procs.append(
            subprocess.Popen(
                [
                    "ip",
                    "netns",
                    "exec",
                    ns,
                    sys.executable,
                    "-m",
                    "kubetune",
                    "train",
                    *dist_overrides,
                    "parallel.timeout_s=120",
                    f"output_dir={run}",
                ],
                env=env,
                cwd=REPO,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    outs = [finish(p) for p in procs]
    assert "2 process(es)" in outs[0]
    assert json.loads((run / "summary.json").read_text())["steps"] == 4


@pytest.mark.slow  # CI's time: a further combination of what the default suite covers
def test_pytorchjob_with_torchrun_per_pod(tmp_path, dist_overrides):
    """nprocPerNode=2 on one pod: the operator sets PET_* and kubetune starts torchrun itself."""
    port = str(free_port())
    run = tmp_path / "pet"
    proc = start_kubetune(["train", *dist_overrides, f"output_dir={run}"], env=pod_env(port))
    out = finish(proc)
    assert "2 process(es)" in out
    assert json.loads((run / "summary.json").read_text())["steps"] == 4
