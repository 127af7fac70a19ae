"""Regenerate the committed *_pb2.py / *_pb2_grpc.py from the .proto files next to this script.

    python -m kubetune.cluster.dra.proto.regenerate

grpcio-tools is a dev dependency only; the generated modules are committed so that the
DRA driver needs just grpcio + protobuf at run time. The generated imports are made
package-relative, because protoc writes `import dra_v1_pb2` (a top-level module).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
PROTOS = ("dra_v1.proto", "dra_v1beta1.proto", "dra_health_v1alpha1.proto", "pluginregistration.proto")


def main() -> int:
    from grpc_tools import protoc  # dev dependency

    for proto in PROTOS:
        rc = protoc.main(
            [
                "grpc_tools.protoc",
                f"-I{HERE}",
                f"--python_out={HERE}",
                f"--pyi_out={HERE}",
                f"--grpc_python_out={HERE}",
                str(HERE / proto),
            ]
        )
        if rc != 0:
            print(f"protoc failed on {proto} (exit {rc})", file=sys.stderr)
            return rc
        stem = proto.removesuffix(".proto")
        grpc_module = HERE / f"{stem}_pb2_grpc.py"
        text = grpc_module.read_text()
        grpc_module.write_text(re.sub(rf"^import {stem}_pb2 as", f"from . import {stem}_pb2 as", text, flags=re.M))
        print(f"regenerated {stem}_pb2.py, {stem}_pb2.pyi, {stem}_pb2_grpc.py")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
