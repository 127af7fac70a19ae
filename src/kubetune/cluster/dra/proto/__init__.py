"""Generated protobuf / gRPC modules for the kubelet's DRA plugin and plugin-registration APIs.

The .proto files are byte-for-byte copies from `kubernetes/kubelet` tag `kubernetes-1.36.3`
(Apache License 2.0), renamed because all four are `api.proto` upstream and protobuf's
descriptor pool keys files by name:

| here | upstream path |
| --- | --- |
| dra_v1.proto | pkg/apis/dra/v1/api.proto |
| dra_v1beta1.proto | pkg/apis/dra/v1beta1/api.proto |
| dra_health_v1alpha1.proto | pkg/apis/dra-health/v1alpha1/api.proto (not served yet) |
| pluginregistration.proto | pkg/apis/pluginregistration/v1/api.proto |

Blobs and checksums: ../shared/reference/dra/README.md in the project's shared tree. Do not
edit the *_pb2*.py files; edit the .proto and run `regenerate.py`.
"""
