"""Regenerate the committed *_pb2.py / *_pb2.pyi / *_pb2_grpc.py from the .proto files of the
device plugin (`deviceplugin/proto/`) and of the DRA driver (`dra/proto/`).

    python -m kubetune.cluster.regenerate_protos

grpcio-tools is a dev dependency only; the generated modules are committed so that the
components need just grpcio + protobuf at run time. The generated imports are made
package-relative, because protoc writes `import deviceplugin_pb2` (a top-level module).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
PROTOS = {
    HERE / "deviceplugin" / "proto": ("deviceplugin.proto", "podresources.proto"),
    HERE / "dra" / "proto": (
        "dra_v1.proto",
        "dra_v1beta1.proto",
        "dra_health_v1alpha1.proto",
        "pluginregistration.proto",
    ),
}


def regenerate(folder: Path, proto: str) -> int:
    from grpc_tools import protoc  # dev dependency

    out = [f"-I{folder}", f"--python_out={folder}", f"--pyi_out={folder}", f"--grpc_python_out={folder}"]
    rc = protoc.main(["grpc_tools.protoc", *out, str(folder / proto)])
    if rc != 0:
        print(f"protoc failed on {proto} (exit {rc})", file=sys.stderr)
        return rc
    stem = proto.removesuffix(".proto")
    grpc_module = folder / f"{stem}_pb2_grpc.py"
    text = grpc_module.read_text()
    grpc_module.write_text(re.sub(rf"^import {stem}_pb2 as", f"from . import {stem}_pb2 as", text, flags=re.M))
    print(f"regenerated {stem}_pb2.py, {stem}_pb2.pyi, {stem}_pb2_grpc.py")
    return 0


def main() -> int:
    for folder, protos in PROTOS.items():
        for proto in protos:
            rc = regenerate(folder, proto)
            if rc != 0:
                return rc
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
