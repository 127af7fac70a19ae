"""The `comm` recipe section: collective-communication and threading settings as environment.

One section, rendered per accelerator kind by `comm_env`: NCCL_* only for `nvidia`, HCCL_*
only for `gaudi`, GLOO_SOCKET_IFNAME and the OpenMP threading/affinity variables for every
kind (gloo also carries the CPU-side groups on GPU and Gaudi jobs). Unset keys are left to
the library's own default, except the few per-kind defaults in `comm_env`, each with its
reason. `docs/comm.md` documents every key.

Pure: no torch, no kubernetes. `kubetune k8s render` puts the result in the pod env; local
launchers can apply it to `os.environ` before the process group starts.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator, model_validator

from kubetune.recipe.base import Section

AcceleratorKind = Literal["cpu", "gaudi", "nvidia"]
ACCELERATOR_KINDS: tuple[str, ...] = ("cpu", "gaudi", "nvidia")

_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# Names NCCL accepts in NCCL_ALGO / NCCL_PROTO (2.2x); lists may use `,`, `^` (exclude) and
# per-collective `allreduce:tree;...` forms, so only the words are checked.
_NCCL_ALGOS = {"ring", "tree", "collnet", "collnetdirect", "collnetchain", "nvls", "nvlstree", "pat"}
_NCCL_PROTOS = {"ll", "ll128", "simple"}
_NCCL_FUNCS = {"broadcast", "reduce", "allgather", "reducescatter", "allreduce", "sendrecv"}


# NCCL reads its numeric variables with strtoll, which stops at the first letter: NCCL_BUFFSIZE=8M
# would be read as 8 bytes. Sizes written with NCCL's units (K, M, G, as in nccl-tests' `-b 8M`;
# powers of 1024, like NCCL's 4 MiB default 4194304) are turned into the byte count here.
_NCCL_SIZE = re.compile(r"^\s*(\d+)\s*([kmg])(i?b)?\s*$", re.IGNORECASE)
_NCCL_UNITS = {"k": 2**10, "m": 2**20, "g": 2**30}


def nccl_bytes(value: object) -> object:
    """`8M` / `8MB` / `8MiB` -> 8388608; anything else is returned as it is."""
    if isinstance(value, str) and (m := _NCCL_SIZE.match(value)):
        return int(m.group(1)) * _NCCL_UNITS[m.group(2).lower()]
    return value


def _check_nccl_words(value: str | None, allowed: set[str], key: str) -> str | None:
    if value is None:
        return value
    words = [w.strip().lstrip("^").lower() for w in re.split(r"[,;:]", value) if w.strip()]
    bad = [w for w in words if w not in allowed and w not in _NCCL_FUNCS]
    if not words or bad:
        raise ValueError(f"unknown {key} {', '.join(bad) or repr(value)}; choose from {', '.join(sorted(allowed))}")
    return value


class NcclSection(Section):
    """NCCL (NVIDIA) settings; rendered only for accelerator kind `nvidia`."""

    socket_ifname: str | None = Field(
        None,
        description="NCCL_SOCKET_IFNAME: interfaces for bootstrap and socket transport (e.g. `eth0`, "
        "`=eth0`, `^docker,lo`); default: comm.socket_ifname.",
    )
    ib_hca: str | None = Field(None, description="NCCL_IB_HCA: InfiniBand/RoCE adapters to use (e.g. `mlx5_0,mlx5_1`).")
    ib_disable: bool | None = Field(
        None, description="NCCL_IB_DISABLE: true = never use InfiniBand/RoCE, sockets only."
    )
    algo: str | None = Field(None, description="NCCL_ALGO: Ring | Tree | NVLS | PAT | ... (a list; `^` excludes).")
    proto: str | None = Field(None, description="NCCL_PROTO: LL | LL128 | Simple (a list; `^` excludes).")
    buffsize: int | None = Field(
        None,
        ge=65536,
        description="NCCL_BUFFSIZE: bytes per channel buffer, or with K/M/G (powers of 1024): 8M = 8388608 "
        "(NCCL default 4194304).",
    )
    nsocks_perthread: int | None = Field(
        None, ge=1, le=64, description="NCCL_NSOCKS_PERTHREAD: sockets per helper thread (socket transport)."
    )
    socket_nthreads: int | None = Field(
        None, ge=1, le=16, description="NCCL_SOCKET_NTHREADS: helper threads per connection (socket transport)."
    )
    debug: Literal["VERSION", "WARN", "INFO", "TRACE"] | None = Field(
        None, description="NCCL_DEBUG: log level (kubetune default WARN, so errors explain themselves)."
    )
    debug_subsys: str | None = Field(None, description="NCCL_DEBUG_SUBSYS: subsystems to log (e.g. `INIT,NET`).")

    @field_validator("buffsize", mode="before")
    @classmethod
    def _buffsize(cls, v: object) -> object:
        v = nccl_bytes(v)
        if isinstance(v, str):
            try:
                return int(v.strip(), 0)  # what strtoll(base 0) reads: 8388608, 0x800000
            except ValueError:
                raise ValueError(f"{v!r} is not a size: give bytes (8388608) or NCCL's units K, M, G (8M)") from None
        return v

    @field_validator("algo")
    @classmethod
    def _algo(cls, v: str | None) -> str | None:
        return _check_nccl_words(v, _NCCL_ALGOS, "NCCL algorithm")

    @field_validator("proto")
    @classmethod
    def _proto(cls, v: str | None) -> str | None:
        return _check_nccl_words(v, _NCCL_PROTOS, "NCCL protocol")

    @model_validator(mode="after")
    def _socket_budget(self) -> NcclSection:
        # NCCL refuses more than 64 sockets per connection (threads x sockets per thread).
        if self.nsocks_perthread and self.socket_nthreads and self.nsocks_perthread * self.socket_nthreads > 64:
            raise ValueError("nccl.nsocks_perthread x nccl.socket_nthreads must be at most 64 (NCCL's limit)")
        return self


ScaleOut = Literal["auto", "gaudi_nics", "host_nic_ofi"]


class HcclSection(Section):
    """HCCL (Intel Gaudi) settings; rendered only for accelerator kind `gaudi`."""

    scale_out: ScaleOut = Field(
        "auto",
        description="How nodes reach each other: gaudi_nics (the cards' integrated RoCE ports; Gaudi2: 3 of 24 "
        "100GbE per card), host_nic_ofi (host NICs through libfabric: HCCL_OVER_OFI=1, FI_PROVIDER), or auto "
        "(HCCL detects: Gaudi NICs, then host NICs). k8s.network holds what the pod needs for each.",
    )
    socket_ifname: str | None = Field(
        None,
        description="HCCL_SOCKET_IFNAME: interface prefix for HCCL's side-band TCP traffic; "
        "default: comm.socket_ifname.",
    )
    over_ofi: bool | None = Field(
        None,
        description="HCCL_OVER_OFI: true = scale out through host NICs over libfabric (disables HCCL's "
        "auto-detection); null = auto (Gaudi NICs first).",
    )
    gaudi_direct: bool | None = Field(
        None, description="HCCL_GAUDI_DIRECT: true = host-NIC scale-out with Gaudi Direct RDMA (no host bounce)."
    )
    ofi_provider: str | None = Field(
        None,
        description="FI_PROVIDER: libfabric provider for HCCL over OFI (`verbs`, `efa`, `tcp`); "
        "scale_out=host_nic_ofi defaults it to verbs (RoCE / InfiniBand host NICs).",
    )

    @model_validator(mode="after")
    def _one_scale_out(self) -> HcclSection:
        if self.scale_out == "gaudi_nics" and (self.over_ofi or self.gaudi_direct):
            raise ValueError(
                "comm.hccl.scale_out=gaudi_nics contradicts comm.hccl.over_ofi / gaudi_direct (host NICs); "
                "unset those, or use scale_out=host_nic_ofi"
            )
        if self.scale_out == "host_nic_ofi" and self.over_ofi is False:
            raise ValueError("comm.hccl.scale_out=host_nic_ofi means HCCL_OVER_OFI=1; unset comm.hccl.over_ofi")
        return self


class CommSection(Section):
    """How processes talk to each other and how many threads each one runs."""

    socket_ifname: str | None = Field(
        None,
        description="Network interface for every backend's TCP traffic (GLOO_SOCKET_IFNAME and, unless "
        "set below, NCCL_/HCCL_SOCKET_IFNAME), e.g. `eth0`; null = let each library pick.",
    )
    threads_per_process: int | None = Field(
        None,
        ge=1,
        description="OMP_NUM_THREADS (and torch intra-op threads); null = CPUs per process "
        "(the pod's CPU limit / processes per pod, or the machine's cores / local processes).",
    )
    affinity: Literal["auto", "none", "close", "spread"] = Field(
        "auto",
        description="OpenMP thread placement: close (OMP_PROC_BIND=close, OMP_PLACES=cores), spread, none "
        "(OMP_PROC_BIND=false); auto = close on cpu with one process per pod or host, else none.",
    )
    gloo_socket_ifname: str | None = Field(
        None, description="GLOO_SOCKET_IFNAME (gloo: CPU collectives); default: comm.socket_ifname."
    )
    nccl: NcclSection = Field(default_factory=NcclSection, description="NCCL settings (nvidia).")
    hccl: HcclSection = Field(default_factory=HcclSection, description="HCCL settings (gaudi).")
    extra_env: dict[str, str] = Field(
        default_factory=dict,
        description="Any other environment variables, set last (they override the ones above), "
        "e.g. {NCCL_P2P_LEVEL: NVL}.",
    )

    @field_validator("extra_env", mode="before")
    @classmethod
    def _env_names(cls, v: object) -> object:
        if isinstance(v, dict):
            bad = [k for k in v if not isinstance(k, str) or not _ENV_NAME.match(k)]
            if bad:
                raise ValueError(f"not environment variable names: {', '.join(map(str, bad))}")
            # YAML turns `1`, `true` into int/bool; the environment only holds strings. NCCL
            # sizes with units become bytes (NCCL itself would read `8M` as 8).
            return {k: _env_str(nccl_bytes(val) if k.startswith("NCCL_") else val) for k, val in v.items()}
        return v


def _env_str(value: object) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    return str(value)


def _affinity(comm: CommSection, kind: str, processes_per_host: int) -> dict[str, str]:
    mode = comm.affinity
    if mode == "auto":
        # Binding threads is only safe when one process owns the pod's CPUs: with several
        # processes, every one would bind its thread 0 to the same first core.
        mode = "close" if kind == "cpu" and processes_per_host == 1 else "none"
    if mode == "none":
        return {"OMP_PROC_BIND": "false"}
    env = {"OMP_PROC_BIND": mode, "OMP_PLACES": "cores"}
    if kind == "cpu":
        # Intel OpenMP (used when libiomp is preloaded) spins 200 ms after each parallel region
        # by default; 1 ms gives the cores back to the data loader and gloo between ops.
        env["KMP_BLOCKTIME"] = "1"
    return env


def _nccl(n: NcclSection, default_ifname: str | None) -> dict[str, str]:
    values = {
        "NCCL_SOCKET_IFNAME": n.socket_ifname or default_ifname,
        "NCCL_IB_HCA": n.ib_hca,
        "NCCL_IB_DISABLE": n.ib_disable,
        "NCCL_ALGO": n.algo,
        "NCCL_PROTO": n.proto,
        "NCCL_BUFFSIZE": n.buffsize,
        "NCCL_NSOCKS_PERTHREAD": n.nsocks_perthread,
        "NCCL_SOCKET_NTHREADS": n.socket_nthreads,
        # WARN by default: a failing collective then says why instead of only timing out.
        "NCCL_DEBUG": n.debug or "WARN",
        "NCCL_DEBUG_SUBSYS": n.debug_subsys,
    }
    return {k: _env_str(v) for k, v in values.items() if v is not None}


# Host-NIC scale-out as Habana documents it ("Scale-out via Host NIC",
# https://docs.habana.ai/en/latest/API_Reference_Guides/HCCL_APIs/Scale_Out_via_Host_NIC.html):
# HCCL_OVER_OFI=1 turns auto-detection off and sends scale-out through libfabric; Gaudi Direct
# (the NIC reads card memory, no host bounce) needs RDMAV_FORK_SAFE=1 with MLX5_SCATTER_TO_CQE=0
# on verbs, or with FI_EFA_USE_DEVICE_RDMA=1 on AWS EFA.
_GAUDI_DIRECT_ENV = {
    "verbs": {"RDMAV_FORK_SAFE": "1", "MLX5_SCATTER_TO_CQE": "0"},
    "efa": {"RDMAV_FORK_SAFE": "1", "FI_EFA_USE_DEVICE_RDMA": "1"},
}


def _hccl(h: HcclSection, default_ifname: str | None) -> dict[str, str]:
    ofi = h.scale_out == "host_nic_ofi"
    provider = h.ofi_provider or ("verbs" if ofi else None)
    values = {
        "HCCL_SOCKET_IFNAME": h.socket_ifname or default_ifname,
        "HCCL_OVER_OFI": True if ofi else h.over_ofi,
        "HCCL_GAUDI_DIRECT": h.gaudi_direct,
        "FI_PROVIDER": provider,
    }
    env = {k: _env_str(v) for k, v in values.items() if v is not None}
    if h.gaudi_direct:
        env.update(_GAUDI_DIRECT_ENV.get(provider or "", {}))
    return env


def comm_env(
    comm: CommSection,
    kind: str,
    cpus_per_process: int | None = None,
    processes_per_host: int = 1,
) -> dict[str, str]:
    """Environment variables for `comm` on accelerator `kind` (cpu | gaudi | nvidia).

    `cpus_per_process` sizes OMP_NUM_THREADS when `comm.threads_per_process` is null; with
    neither, OMP_NUM_THREADS is left to the launcher. The order is stable (for snapshots).
    """
    if kind not in ACCELERATOR_KINDS:
        raise ValueError(f"unknown accelerator kind {kind!r}; choose from {', '.join(ACCELERATOR_KINDS)}")
    env: dict[str, str] = {}
    threads = comm.threads_per_process or (max(1, int(cpus_per_process)) if cpus_per_process else None)
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    env.update(_affinity(comm, kind, processes_per_host))
    gloo_ifname = comm.gloo_socket_ifname or comm.socket_ifname
    if gloo_ifname:
        env["GLOO_SOCKET_IFNAME"] = gloo_ifname
    if kind == "nvidia":
        env.update(_nccl(comm.nccl, comm.socket_ifname))
    elif kind == "gaudi":
        env.update(_hccl(comm.hccl, comm.socket_ifname))
    env.update(comm.extra_env)
    return env


# ------------------------------------------------------------------ settings that do nothing here
# `comm_env` renders only the active kind's backend. A key of another backend is dropped, so
# `comm_warnings` says so, with the setting that does the same job where there is one.

_BACKEND = {"cpu": "gloo", "gaudi": "HCCL", "nvidia": "NCCL"}
# Intel Gaudi: HCCL scales out over the Gaudi NICs or, through libfabric, over host NICs; it
# chooses its own algorithms, protocols and buffers (docs.habana.ai, HCCL "Scale-out via Host NIC").
_COUNTERPART = {
    ("nccl", "gaudi"): {
        "socket_ifname": "comm.hccl.socket_ifname (HCCL_SOCKET_IFNAME)",
        "ib_hca": "comm.hccl.over_ofi=true with comm.hccl.ofi_provider=verbs (host NICs over libfabric)",
        "ib_disable": "comm.hccl.over_ofi=true with comm.hccl.ofi_provider=tcp (host NICs over TCP)",
        "debug": "comm.extra_env ENABLE_CONSOLE=true and LOG_LEVEL_ALL (0 = most verbose, 6 = none)",
        "debug_subsys": "comm.extra_env ENABLE_CONSOLE=true and LOG_LEVEL_ALL (0 = most verbose, 6 = none)",
    },
    ("nccl", "cpu"): {"socket_ifname": "comm.gloo_socket_ifname (GLOO_SOCKET_IFNAME)"},
    ("hccl", "nvidia"): {
        "socket_ifname": "comm.nccl.socket_ifname (NCCL_SOCKET_IFNAME)",
        "scale_out": "comm.nccl.ib_hca / ib_disable for NCCL's network, k8s.network for the pods' RDMA devices",
    },
    ("hccl", "cpu"): {"socket_ifname": "comm.gloo_socket_ifname (GLOO_SOCKET_IFNAME)"},
}
_NO_COUNTERPART = {
    "gaudi": "HCCL has no counterpart: it chooses its own algorithms, protocols and buffers",
    "nvidia": "NCCL has no counterpart (comm.nccl.ib_hca / ib_disable choose its network)",
    "cpu": "gloo has no counterpart",
}
# oneCCL and Intel MPI read these; kubetune's collectives never load either library.
_ONECCL_PREFIXES = ("CCL_", "I_MPI_")


def _dropped(comm: CommSection, section: str, kind: str) -> list[str]:
    values = getattr(comm, section).model_dump(exclude_defaults=True)
    if not values:
        return []
    lines, counterparts = [], _COUNTERPART.get((section, kind), {})
    why = f"not rendered on {kind}: a {kind} job's collectives run on {_BACKEND[kind]}"
    for key in [k for k in values if k in counterparts]:
        lines.append(f"comm.{section}.{key} is {why}; use {counterparts[key]}")
    orphans = [f"comm.{section}.{k}" for k in values if k not in counterparts]
    if orphans:
        lines.append(f"{', '.join(orphans)} {'is' if len(orphans) == 1 else 'are'} {why}, and {_NO_COUNTERPART[kind]}")
    return lines


def oneccl_variables(env: dict[str, str] | list[str]) -> list[str]:
    """The oneCCL / Intel MPI variables (CCL_*, I_MPI_*) among these names."""
    return sorted(name for name in env if name.startswith(_ONECCL_PREFIXES))


def oneccl_advice(kind: str = "cpu") -> str:
    """What to set instead of oneCCL / Intel MPI variables (the troubleshooting of Intel's Xeon guide checks them)."""
    ifname = "GLOO_SOCKET_IFNAME" + {"gaudi": ", HCCL_SOCKET_IFNAME", "nvidia": ", NCCL_SOCKET_IFNAME"}.get(kind, "")
    return (
        f"kubetune's collectives run on {_BACKEND[kind]} (torch.distributed), not oneCCL or Intel MPI, so these do "
        f"nothing: set the interface with comm.socket_ifname ({ifname}), threads per process with "
        "comm.threads_per_process (OMP_NUM_THREADS) and pinning with comm.affinity (OMP_PROC_BIND, OMP_PLACES), "
        "and remove them from comm.extra_env"
    )


def comm_warnings(comm: CommSection, kind: str) -> list[str]:
    """Settings that `comm_env` drops or that nothing reads on accelerator `kind`, one line each."""
    lines = []
    if kind != "nvidia":
        lines += _dropped(comm, "nccl", kind)
    if kind != "gaudi":
        lines += _dropped(comm, "hccl", kind)
    if names := oneccl_variables(list(comm.extra_env)):
        lines.append(f"comm.extra_env sets {', '.join(names)}: {oneccl_advice(kind)}")
    return lines
