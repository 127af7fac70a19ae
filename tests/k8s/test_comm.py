"""The `comm` recipe section rendered to environment variables per accelerator kind."""

from __future__ import annotations

import pytest
from pydantic import BaseModel

from kubetune.errors import RecipeError
from kubetune.recipe.comm import CommSection, HcclSection, NcclSection, comm_env, comm_warnings, oneccl_variables
from kubetune.recipe.loader import load_recipe


def comm(*overrides) -> CommSection:
    return load_recipe("smollm2-135m-lora-cpu", list(overrides)).recipe.comm


def test_defaults_per_kind():
    c = CommSection()
    assert comm_env(c, "cpu", cpus_per_process=8) == {
        "OMP_NUM_THREADS": "8",
        "OMP_PROC_BIND": "close",
        "OMP_PLACES": "cores",
        "KMP_BLOCKTIME": "1",
    }
    assert comm_env(c, "nvidia", cpus_per_process=4, processes_per_host=8) == {
        "OMP_NUM_THREADS": "4",
        "OMP_PROC_BIND": "false",
        "NCCL_DEBUG": "WARN",
    }
    assert comm_env(c, "gaudi", cpus_per_process=8, processes_per_host=8) == {
        "OMP_NUM_THREADS": "8",
        "OMP_PROC_BIND": "false",
    }


def test_no_binding_with_several_processes_per_host():
    # every process would pin its first thread to the same core
    assert comm_env(CommSection(), "cpu", 4, processes_per_host=2)["OMP_PROC_BIND"] == "false"
    assert comm_env(comm("comm.affinity=spread"), "cpu", 4, processes_per_host=2)["OMP_PROC_BIND"] == "spread"


def test_the_seed_nccl_table_is_expressible():
    # the seed's table as issue 11 quotes it: Tree / Simple / 8M / 4 (NCCL_BUFFSIZE written `8M`)
    c = comm(
        "comm.nccl.algo=Tree",
        "comm.nccl.proto=Simple",
        "comm.nccl.buffsize=8M",
        "comm.nccl.nsocks_perthread=4",
        "comm.nccl.socket_nthreads=2",
        "comm.nccl.ib_hca=mlx5_0,mlx5_1",
        "comm.nccl.ib_disable=false",
        "comm.nccl.debug=INFO",
        "comm.nccl.debug_subsys=INIT,NET",
    )
    env = comm_env(c, "nvidia")
    assert {k: env[k] for k in env if k.startswith("NCCL_")} == {
        "NCCL_IB_HCA": "mlx5_0,mlx5_1",
        "NCCL_IB_DISABLE": "0",
        "NCCL_ALGO": "Tree",
        "NCCL_PROTO": "Simple",
        "NCCL_BUFFSIZE": "8388608",  # the bytes NCCL reads; it would read `8M` as 8
        "NCCL_NSOCKS_PERTHREAD": "4",
        "NCCL_SOCKET_NTHREADS": "2",
        "NCCL_DEBUG": "INFO",
        "NCCL_DEBUG_SUBSYS": "INIT,NET",
    }
    assert "OMP_NUM_THREADS" not in env  # nothing to size it from: left to the launcher
    assert not any(k.startswith("NCCL_") for k in comm_env(c, "cpu"))  # NCCL only on nvidia


def test_socket_ifname_reaches_every_backend_unless_overridden():
    c = comm("comm.socket_ifname=eth0", "comm.nccl.socket_ifname=^docker,lo")
    nv, gaudi = comm_env(c, "nvidia"), comm_env(c, "gaudi")
    assert nv["GLOO_SOCKET_IFNAME"] == "eth0" and nv["NCCL_SOCKET_IFNAME"] == "^docker,lo"
    assert gaudi["HCCL_SOCKET_IFNAME"] == "eth0" and gaudi["GLOO_SOCKET_IFNAME"] == "eth0"
    assert (
        comm_env(comm("comm.socket_ifname=eth0", "comm.gloo_socket_ifname=ib0"), "cpu")["GLOO_SOCKET_IFNAME"] == "ib0"
    )


def test_hccl_keys():
    env = comm_env(
        comm("comm.hccl.over_ofi=true", "comm.hccl.gaudi_direct=true", "comm.hccl.ofi_provider=verbs"), "gaudi"
    )
    assert (env["HCCL_OVER_OFI"], env["HCCL_GAUDI_DIRECT"], env["FI_PROVIDER"]) == ("1", "1", "verbs")


def test_threads_and_extra_env_override():
    c = comm(
        "comm.threads_per_process=3",
        "comm.extra_env.OMP_PROC_BIND=master",
        "comm.extra_env.TORCH_SHOW_CPP_STACKTRACES=1",
    )
    env = comm_env(c, "cpu", cpus_per_process=8)
    assert env["OMP_NUM_THREADS"] == "3"
    assert env["OMP_PROC_BIND"] == "master"  # extra_env is applied last
    assert env["TORCH_SHOW_CPP_STACKTRACES"] == "1"
    assert comm_env(CommSection(), "cpu", cpus_per_process=0.5)["OMP_NUM_THREADS"] == "1"


@pytest.mark.parametrize(
    "override,message",
    [
        ("comm.nccl.algo=Rnig", "unknown NCCL algorithm rnig"),
        ("comm.nccl.proto=LL256", "unknown NCCL protocol ll256"),
        ("comm.nccl.buffsize=10", "greater than or equal to 65536"),
        ("comm.nccl.buffsize=8X", "'8X' is not a size: give bytes (8388608) or NCCL's units K, M, G (8M)"),
        ("comm.nccl.buffsize=1K", "greater than or equal to 65536"),
        ("comm.affinity=tight", "expected 'auto', 'none', 'close' or 'spread'"),
        ("comm.extra_env={'1BAD': x}", "not environment variable names: 1BAD"),
        ("comm.ncl.algo=Ring", "unknown recipe key `comm.ncl`: did you mean `comm.nccl`?"),
    ],
)
def test_bad_values_are_one_line_each(override, message):
    with pytest.raises(RecipeError) as err:
        comm(override)
    assert len(err.value.problems) == 1 and message in err.value.problems[0]


@pytest.mark.parametrize(
    "value,size",
    [("8M", 8 * 2**20), ("8MB", 8 * 2**20), ("8MiB", 8 * 2**20), ("512k", 512 * 2**10), ("1G", 2**30),
     ("4194304", 4194304), ("0x800000", 8 * 2**20)],
)  # fmt: skip
def test_nccl_buffsize_takes_nccls_units_and_renders_bytes(value, size):
    c = comm(f"comm.nccl.buffsize={value}")
    assert c.nccl.buffsize == size and comm_env(c, "nvidia")["NCCL_BUFFSIZE"] == str(size)


def test_nccl_sizes_in_extra_env_become_bytes_too():
    env = comm_env(comm("comm.extra_env.NCCL_BUFFSIZE=8M", "comm.extra_env.OTHER=8M"), "nvidia")
    assert env["NCCL_BUFFSIZE"] == "8388608" and env["OTHER"] == "8M"  # only NCCL's own variables


def test_nccl_keys_on_gaudi_warn_with_the_hccl_counterpart():
    c = comm(
        "comm.nccl.algo=Tree",
        "comm.nccl.proto=Simple",
        "comm.nccl.buffsize=8M",
        "comm.nccl.nsocks_perthread=4",
        "comm.nccl.socket_ifname=eth0",
        "comm.nccl.debug=INFO",
    )
    lines = comm_warnings(c, "gaudi")
    assert not any(k.startswith("NCCL_") for k in comm_env(c, "gaudi"))  # dropped ...
    text = "\n".join(lines)  # ... but not silently
    assert "comm.nccl.socket_ifname is not rendered on gaudi" in text and "use comm.hccl.socket_ifname" in text
    assert "comm.nccl.debug is not rendered on gaudi" in text and "LOG_LEVEL_ALL" in text
    assert (
        "comm.nccl.algo, comm.nccl.proto, comm.nccl.buffsize, comm.nccl.nsocks_perthread are not rendered on "
        "gaudi: a gaudi job's collectives run on HCCL, and HCCL has no counterpart" in text
    )
    assert comm_warnings(c, "nvidia") == []
    assert "use comm.gloo_socket_ifname" in "\n".join(comm_warnings(c, "cpu"))
    assert comm_warnings(CommSection(), "gaudi") == []  # kubetune's own NCCL_DEBUG default is no warning


def test_hccl_keys_elsewhere_warn():
    c = comm("comm.hccl.over_ofi=true", "comm.hccl.socket_ifname=eth1")
    assert comm_warnings(c, "gaudi") == []
    (iface, over_ofi) = comm_warnings(c, "nvidia")
    assert "comm.hccl.socket_ifname" in iface and "use comm.nccl.socket_ifname" in iface
    assert over_ofi.startswith("comm.hccl.over_ofi is not rendered on nvidia")


def test_oneccl_variables_in_extra_env_say_what_to_set_instead():
    c = comm("comm.extra_env.CCL_WORKER_COUNT=4", "comm.extra_env.I_MPI_PIN_DOMAIN=socket")
    (line,) = comm_warnings(c, "cpu")
    assert line.startswith("comm.extra_env sets CCL_WORKER_COUNT, I_MPI_PIN_DOMAIN: ")
    assert "run on gloo" in line and "comm.threads_per_process" in line and "comm.socket_ifname" in line
    assert oneccl_variables({"CCL_ATL_TRANSPORT": "ofi", "NCCL_ALGO": "Tree"}) == ["CCL_ATL_TRANSPORT"]


def test_render_warns_about_the_gaudi_recipes_nccl_table():
    from kubetune.k8s.render import render

    gaudi = render(load_recipe("llama2-13b-gaudi-tp4-pp8").recipe)
    assert any("comm.nccl.buffsize" in w and "HCCL has no counterpart" in w for w in gaudi.warnings)
    nvidia = render(load_recipe("llama2-13b-gaudi-tp4-pp8", ["k8s.profile=nvidia"]).recipe)
    assert not any(w.startswith("comm.nccl") for w in nvidia.warnings)


def test_nccl_socket_limit():
    with pytest.raises(RecipeError, match="at most 64"):
        comm("comm.nccl.nsocks_perthread=8", "comm.nccl.socket_nthreads=16")


def test_nccl_lists_and_exclusions_are_accepted():
    assert comm("comm.nccl.algo=^NVLS,tree").nccl.algo == "^NVLS,tree"
    assert comm("comm.nccl.algo=allreduce:ring;broadcast:tree").nccl.algo == "allreduce:ring;broadcast:tree"


def test_unknown_kind():
    with pytest.raises(ValueError, match="unknown accelerator kind 'tpu'"):
        comm_env(CommSection(), "tpu")


@pytest.mark.parametrize("model", [CommSection, NcclSection, HcclSection])
def test_every_key_is_documented(model: type[BaseModel]):
    for name, info in model.model_fields.items():
        assert info.description and len(info.description) > 15, f"{model.__name__}.{name}"


def test_reference_lists_comm_keys():
    from kubetune.recipe.loader import reference_markdown

    table = reference_markdown()
    for key in (
        "comm.socket_ifname",
        "comm.nccl.algo",
        "comm.nccl.nsocks_perthread",
        "comm.hccl.over_ofi",
        "comm.extra_env",
    ):
        assert f"| `{key}` |" in table


# ------------------------------------------------------------------ scale-out between nodes


def _hccl_env(*overrides: str) -> dict[str, str]:
    env = comm_env(comm(*overrides), "gaudi", cpus_per_process=8, processes_per_host=8)
    return {k: v for k, v in env.items() if not k.startswith("OMP_")}


def test_host_nic_scale_out_renders_habanas_variables():
    assert _hccl_env() == {}  # auto: HCCL's own detection, nothing forced
    assert _hccl_env("comm.hccl.scale_out=gaudi_nics") == {}  # the cards' own ports: nothing to say
    assert _hccl_env("comm.hccl.scale_out=host_nic_ofi") == {"HCCL_OVER_OFI": "1", "FI_PROVIDER": "verbs"}
    assert _hccl_env("comm.hccl.scale_out=host_nic_ofi", "comm.hccl.gaudi_direct=true", "comm.socket_ifname=ens1") == {
        "GLOO_SOCKET_IFNAME": "ens1",
        "HCCL_SOCKET_IFNAME": "ens1",
        "HCCL_OVER_OFI": "1",
        "HCCL_GAUDI_DIRECT": "1",
        "FI_PROVIDER": "verbs",
        "RDMAV_FORK_SAFE": "1",
        "MLX5_SCATTER_TO_CQE": "0",
    }
    efa = _hccl_env("comm.hccl.scale_out=host_nic_ofi", "comm.hccl.ofi_provider=efa", "comm.hccl.gaudi_direct=true")
    assert efa["FI_PROVIDER"] == "efa" and efa["FI_EFA_USE_DEVICE_RDMA"] == "1" and "MLX5_SCATTER_TO_CQE" not in efa
    # another kind renders none of it, and says so
    assert not {"HCCL_OVER_OFI", "FI_PROVIDER"} & comm_env(comm("comm.hccl.scale_out=host_nic_ofi"), "nvidia").keys()
    (line,) = comm_warnings(comm("comm.hccl.scale_out=host_nic_ofi"), "nvidia")
    assert line.startswith("comm.hccl.scale_out is not rendered on nvidia") and "k8s.network" in line
    assert comm_warnings(CommSection(), "nvidia") == []  # the default is nobody's setting


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        (["comm.hccl.scale_out=gaudi_nics", "comm.hccl.over_ofi=true"], "comm.hccl.scale_out=gaudi_nics contradicts"),
        (["comm.hccl.scale_out=host_nic_ofi", "comm.hccl.over_ofi=false"], "unset comm.hccl.over_ofi"),
        (["comm.hccl.scale_out=roce"], "comm.hccl.scale_out"),
    ],
)
def test_contradicting_scale_out_settings_are_one_clear_error(overrides, named):
    with pytest.raises(RecipeError, match=named):
        comm(*overrides)


def _rendered(*overrides: str, api: str = "pytorchjob"):
    from kubetune.k8s.render import render

    return render(load_recipe("llama2-13b-gaudi-tp4-pp8", [f"k8s.api={api}", *overrides]).recipe, with_runtime=True)


def _worker(rendered) -> dict:
    job = rendered.objects[-1]
    return next(iter(job["spec"]["pytorchReplicaSpecs"].values()))["template"]


HOST_NICS = (
    "comm.hccl.scale_out=host_nic_ofi",
    "k8s.network.rdma_resource=rdma/roce",
    "k8s.network.rdma_per_pod=2",
    "k8s.network.networks=roce-net@net1",
    "k8s.network.host_network=true",
)


def test_the_seed_scales_out_on_the_gaudi_nics_of_ready_nodes():
    out = _rendered()
    pod = _worker(out)["spec"]
    assert pod["nodeSelector"] == {"intel.feature.node.kubernetes.io/gaudi-scale-out": "true"}
    assert "hostNetwork" not in pod and "IPC_LOCK" not in pod["containers"][0]["securityContext"]["capabilities"]["add"]
    assert not any("scale_out" in w for w in out.warnings)
    one_node = _worker(_rendered("k8s.replicas=1", "parallel.pp=1"))["spec"]
    assert "nodeSelector" not in one_node  # nothing scales out of one node
    anywhere = _worker(_rendered("k8s.network.scale_out_label=null"))["spec"]
    assert "nodeSelector" not in anywhere


def test_host_nic_scale_out_renders_the_pods_rdma_settings():
    out = _rendered(*HOST_NICS)
    template = _worker(out)
    pod, container = template["spec"], template["spec"]["containers"][0]
    assert (pod["hostNetwork"], pod["dnsPolicy"]) == (True, "ClusterFirstWithHostNet")
    assert container["resources"]["limits"]["rdma/roce"] == container["resources"]["requests"]["rdma/roce"] == "2"
    assert container["resources"]["limits"]["habana.ai/gaudi"] == "4"
    assert container["securityContext"]["capabilities"]["add"] == ["SYS_NICE", "IPC_LOCK"]
    assert template["metadata"]["annotations"] == {"k8s.v1.cni.cncf.io/networks": "roce-net@net1"}
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert (env["HCCL_OVER_OFI"], env["FI_PROVIDER"]) == ("1", "verbs")
    assert "nodeSelector" not in pod  # the Gaudi NICs' label is for gaudi_nics only


def test_a_trainjob_carries_the_rdma_device_and_host_network():
    out = _rendered(*HOST_NICS, api="trainjob")
    trainjob = out.objects[-1]
    assert trainjob["spec"]["trainer"]["resourcesPerNode"]["limits"]["rdma/roce"] == "2"
    (runtime,) = [o for o in out.objects if o["kind"] == "ClusterTrainingRuntime"]
    pod = runtime["spec"]["template"]["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    assert (pod["hostNetwork"], pod["dnsPolicy"]) == (True, "ClusterFirstWithHostNet")


def test_host_nics_over_rdma_without_a_device_is_a_warning_naming_the_key():
    warned = [w for w in _rendered("comm.hccl.scale_out=host_nic_ofi").warnings if "scale_out" in w]
    assert len(warned) == 1 and "set k8s.network.rdma_resource" in warned[0]
    tcp = _rendered("comm.hccl.scale_out=host_nic_ofi", "comm.hccl.ofi_provider=tcp")
    assert not any("scale_out" in w for w in tcp.warnings)
    assert "IPC_LOCK" not in _worker(tcp)["spec"]["containers"][0]["securityContext"]["capabilities"]["add"]


def test_cpu_and_nvidia_pods_are_unchanged_unless_asked():
    for profile in ("cpu", "nvidia"):
        pod = _worker(_rendered(f"k8s.profile={profile}", "comm.hccl.scale_out=auto"))["spec"]
        container = pod["containers"][0]
        assert "hostNetwork" not in pod and "dnsPolicy" not in pod
        assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    # an RDMA device on NVIDIA (NCCL over RoCE): the device and IPC_LOCK, still non-root
    nvidia = _worker(_rendered("k8s.profile=nvidia", "comm.hccl.scale_out=auto", "k8s.network.rdma_resource=rdma/roce"))
    container = nvidia["spec"]["containers"][0]
    assert container["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["IPC_LOCK"]}
    assert container["resources"]["limits"]["rdma/roce"] == "1"


def test_the_docs_host_nic_example_renders_as_it_says(tmp_path):
    import re
    from pathlib import Path

    doc = (Path(__file__).parents[2] / "docs" / "comm.md").read_text()
    (block,) = re.findall(r"```yaml\n# scale-out over host NICs with RDMA\n(.*?)```", doc, re.S)
    recipe = tmp_path / "host-nics.yaml"
    recipe.write_text(block)
    loaded = load_recipe(str(recipe), ["k8s.profile=gaudi", "k8s.replicas=2"]).recipe
    env = comm_env(loaded.comm, "gaudi")
    assert (env["HCCL_SOCKET_IFNAME"], env["HCCL_OVER_OFI"], env["HCCL_GAUDI_DIRECT"]) == ("net1", "1", "1")
    from kubetune.k8s.render import render

    out = render(loaded)
    template = out.objects[-1]["spec"]["pytorchReplicaSpecs"]["Master"]["template"]
    assert template["metadata"]["annotations"]["k8s.v1.cni.cncf.io/networks"] == "roce-net@net1"
    assert "rdma/roce" in template["spec"]["containers"][0]["resources"]["limits"]
    assert not any("scale_out" in w for w in out.warnings)
