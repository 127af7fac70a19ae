"""How much memory a training process needs: a rough estimate from the parameter count, without torch.

`kubetune train` uses it to decide whether several processes fit beside each other
(`training.processes`), `kubetune k8s render` (and the operator) to refuse a pod whose memory
could not hold its processes (`memory_problem`). The count comes from the model's shape without
loading it (`layout.model_shape`: a local config.json, the embedded default, a table of well-known
hub ids); a model of unknown shape is not checked.
"""

from __future__ import annotations

from kubetune.contracts.kube import parse_quantity
from kubetune.recipe.layout import model_shape
from kubetune.recipe.schema import Recipe

GIB = 2**30
RUNTIME_BYTES = 1.5 * GIB  # the interpreter, torch and one micro-batch's activations
HOST_COPIES = 1.5  # on a CPU: the frozen base, its casts and the adapters' optimizer state


def weight_width(recipe: Recipe) -> int:
    """Bytes per base weight: 2 where they are held in bf16 or may be (precision auto: decided at
    start-up, so the smaller, to refuse only what surely does not fit), else 4."""
    return 2 if recipe.base_dtype_name() == "bf16" or recipe.train.precision == "auto" else 4


def process_bytes(params: int, width: int) -> float:
    """A rough peak of one training process on a CPU: the weights one and a half times over plus the runtime."""
    return HOST_COPIES * params * width + RUNTIME_BYTES


def pod_bytes(recipe: Recipe) -> tuple[float, str] | None:
    """(the host memory one worker pod needs, how it is counted), or None when the model's size is
    unknown offline. On a CPU each process holds its pipeline stage's share of the weights. With
    accelerators the weights only pass through the host while the processes load them (read from
    the same files, so once) before they move to the cards."""
    shape = model_shape(recipe.model.name_or_path)
    params = shape.parameters if shape is not None else None
    if params is None:
        return None
    k8s, width = recipe.k8s, weight_width(recipe)
    processes, dtype = k8s.processes_per_pod(), "bf16" if width == 2 else "fp32"
    runtime = f"{RUNTIME_BYTES / GIB:g}Gi"
    if k8s.profile == "cpu":
        share = params // recipe.parallel.pp
        each = f"{share / 1e9:.1f}B parameters in {dtype} 1.5 times over plus {runtime}"
        how = f"{processes} training process(es), each {each}"
        return processes * process_bytes(share, width), how
    how = (
        f"{params / 1e9:.1f}B parameters in {dtype} once (loaded through the host before they move to the cards) "
        f"plus {runtime} for each of {processes} training process(es)"
    )
    return params * width + processes * RUNTIME_BYTES, how


def memory_problem(recipe: Recipe) -> str | None:
    """The one-line refusal of a worker pod whose memory is below the estimate for its processes."""
    need = pod_bytes(recipe)
    if need is None:
        return None
    need_bytes, how = need
    k8s = recipe.k8s
    memory = k8s.worker_resources()["memory"]
    if parse_quantity(memory) >= need_bytes:
        return None
    key = k8s.resource_key("memory")
    fewer = ", or fewer processes per pod (k8s.nproc_per_node)" if k8s.processes_per_pod() > 1 else ""
    return (
        f"{key}={memory} is less than the ~{need_bytes / GIB:.1f}Gi one worker pod needs for "
        f"{recipe.model.name_or_path}: {how}; set {key} to at least {-(-need_bytes // GIB):.0f}Gi{fewer}"
    )
