"""Find the accelerator cards of this node: one interface, one module per backend.

As NVIDIA's k8s-device-plugin lays out `internal/plugin/manager/`:

- `discovery`: the `Discovery` interface (cards, health probe, allocation spec, free memory),
  `Card`, `AllocateSpec`, `DriverAbsent` and the sysfs readers the backends share;
- `gaudi`: Gaudi cards from sysfs; `nvidia`: NVIDIA GPUs through NVML; `inventory`: a YAML
  file for demos and tests;
- `wait`: `WaitForDriver`, a hardware backend on a node that may not have its driver (yet);
- `factory`: `make_discovery`, the `--discovery` flag -> a backend;
- `health`: the loop that polls a backend's probe and reports changes.

The device plugin (`kubetune.cluster.deviceplugin`) and the DRA driver (`kubetune.cluster.dra`)
both use it; neither gRPC nor the kubernetes client is imported here.
"""
