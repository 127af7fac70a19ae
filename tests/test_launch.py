"""The launcher's checks say locally what `k8s render` says on the cluster."""

from __future__ import annotations

from kubetune.training.launch import precheck


def test_precheck_warns_about_oneccl_variables_and_still_returns_the_env(capsys, tiny_overrides):
    env = precheck(None, [*tiny_overrides, "comm.extra_env.CCL_WORKER_COUNT=4"], world_size=2, nproc_per_node=2)
    err = capsys.readouterr().err
    assert "kubetune: warning: comm.extra_env sets CCL_WORKER_COUNT" in err and "gloo" in err
    assert env["CCL_WORKER_COUNT"] == "4"  # warned, not dropped: the user asked for it


def test_precheck_is_quiet_for_a_clean_recipe(capsys, tiny_overrides):
    precheck(None, tiny_overrides, world_size=2, nproc_per_node=2)
    assert "warning" not in capsys.readouterr().err
