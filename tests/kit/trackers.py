"""The experiment trackers' own sides for the tests: a real MLflow tracking server (SQLite store,
file artifacts, on loopback) and a reader of Weights & Biases' offline run files."""

from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import sys
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from kubetune.netutil import free_port, wait_ready


@dataclass(frozen=True)
class MlflowServer:
    uri: str
    artifacts: Path


@contextmanager
def mlflow_server(root: Path, timeout: float = 240) -> Iterator[MlflowServer]:
    """`mlflow server` with a SQLite store under ROOT, awaited on /health, its process group
    killed at the end (it starts a uvicorn worker under itself)."""
    port = free_port()
    log = root / "mlflow-server.log"
    argv = [
        *(sys.executable, "-m", "mlflow", "server"),
        *("--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}"),
        *("--default-artifact-root", (root / "artifacts").as_uri()),
        *("--host", "127.0.0.1", "--port", str(port), "--workers", "1"),
    ]
    # the job executor (huey consumers, for MLflow's GenAI jobs) is not what these tests use: it only costs start-up
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        wait_ready(f"http://127.0.0.1:{port}/health", timeout, proc, log, interval=0.25)
        yield MlflowServer(f"http://127.0.0.1:{port}", root / "artifacts")
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


# W&B's transaction log (RUN/wandb/offline-run-*/run-ID.wandb) is LevelDB's log format: a 7-byte
# file header (":W&B", magic 0xBEE1, version 0), then 32 KiB blocks of records, each with a 7-byte
# header (CRC-32, length, type: full / first / middle / last); each record is a wandb.proto Record.
WANDB_HEADER = struct.Struct("<4sHB")
RECORD_HEADER = struct.Struct("<IHB")
BLOCK = 32768
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def wandb_records(path: Path) -> Iterator[bytes]:
    data = path.read_bytes()
    ident, magic, version = WANDB_HEADER.unpack_from(data)
    assert (ident, magic, version) == (b":W&B", 0xBEE1, 0), (ident, magic, version)
    pos, pending = WANDB_HEADER.size, b""
    while pos + RECORD_HEADER.size <= len(data):
        if BLOCK - pos % BLOCK < RECORD_HEADER.size:  # a block's tail too short for a header is padding
            pos += BLOCK - pos % BLOCK
            continue
        crc, length, kind = RECORD_HEADER.unpack_from(data, pos)
        if length == 0 and kind == 0:
            break  # zeros: the end of what was written
        body = data[pos + RECORD_HEADER.size : pos + RECORD_HEADER.size + length]
        assert zlib.crc32(bytes([kind]) + body) & 0xFFFFFFFF == crc, f"bad CRC at {pos} in {path}"
        pos += RECORD_HEADER.size + length
        pending = body if kind in (FULL, FIRST) else pending + body
        if kind in (FULL, LAST):
            yield pending


def wandb_history(run_files: list[Path]) -> dict[str, dict[int, float]]:
    """name -> step -> value of every `run.log` in W&B's run files (as its own proto reads them)."""
    from wandb.proto import wandb_internal_pb2

    out: dict[str, dict[int, float]] = {}
    for path in run_files:
        for raw in wandb_records(path):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(raw)
            if record.WhichOneof("record_type") != "history":
                continue
            items = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            step = items.pop("_step", record.history.step.num)
            for name, value in items.items():
                if not name.startswith("_") and isinstance(value, (int, float)):
                    out.setdefault(name, {})[int(step)] = float(value)
    return out


def wandb_config(run_files: list[Path]) -> dict[str, object]:
    """The config W&B's run files hold (the last value of each key)."""
    from wandb.proto import wandb_internal_pb2

    config: dict[str, object] = {}
    for path in run_files:
        for raw in wandb_records(path):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(raw)
            if record.WhichOneof("record_type") == "config":
                for item in record.config.update:
                    config[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
    return config
