"""Generated protobuf / gRPC modules for the kubelet device plugin and PodResources APIs.

Do not edit the *_pb2*.py files; edit the .proto and run `regenerate.py`.
"""
