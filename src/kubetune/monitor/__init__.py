"""Monitoring: the Prometheus Operator objects, alert rules and Grafana dashboards built over
the metric names kubetune promises (`kubetune.contracts.metrics`), and `kubetune monitor`.

Pure: no torch, no kubernetes import. Training (`kubetune.training.telemetry`) and serving
(`kubetune.serve.native.metrics`) export what it names; the dashboards and alerts query
only those names, and a test fails when a panel names a metric nobody exports.
"""
