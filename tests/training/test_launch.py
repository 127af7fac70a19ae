"""The launcher's checks say locally what `k8s render` says on the cluster."""

from __future__ import annotations

import json

from kubetune.training.launch import LAUNCHER_PRINTS, USER_ERROR_KEY, peer_user_error, precheck


def test_precheck_warns_about_oneccl_variables_and_still_returns_the_env(capsys, tiny_overrides):
    env = precheck(None, [*tiny_overrides, "comm.extra_env.CCL_WORKER_COUNT=4"], world_size=2, nproc_per_node=2)
    err = capsys.readouterr().err
    assert "kubetune: warning: comm.extra_env sets CCL_WORKER_COUNT" in err and "gloo" in err
    assert env["CCL_WORKER_COUNT"] == "4"  # warned, not dropped: the user asked for it


def test_precheck_is_quiet_for_a_clean_recipe(capsys, tiny_overrides):
    precheck(None, tiny_overrides, world_size=2, nproc_per_node=2)
    assert "warning" not in capsys.readouterr().err


def test_the_pods_max_restarts_reach_torchrun_unless_the_cli_names_one(monkeypatch):
    """The Kubeflow operator passes `k8s.elastic.max_restarts` as PET_MAX_RESTARTS; torchrun's
    own parser reads it only when no --max-restarts is on the command line."""
    from torch.distributed.run import get_args_parser

    from kubetune.training.launch import agent_argv

    def parsed(max_restarts):
        argv = agent_argv(None, None, None, None, max_restarts)
        return get_args_parser().parse_args([*argv, "-m", "kubetune", "train"]).max_restarts

    monkeypatch.setenv("PET_MAX_RESTARTS", "3")
    assert parsed(None) == 3  # the pod's elastic setting
    assert parsed(1) == 1  # an explicit flag wins
    monkeypatch.delenv("PET_MAX_RESTARTS")
    assert parsed(None) == 0  # torchrun's own default, as before


# ------------------------------------------------------------------ a peer that stopped on bad input


def _attempt(tmp_path, recorded: dict[int, list[str] | None]):
    attempt = tmp_path / "run" / "attempt_0"
    for rank, problems in recorded.items():
        (attempt / str(rank)).mkdir(parents=True)
        if problems is not None:
            (attempt / str(rank) / "error.json").write_text(json.dumps({USER_ERROR_KEY: problems}))
    return {"TORCHELASTIC_ERROR_FILE": str(attempt / "0" / "error.json"), LAUNCHER_PRINTS: "1"}


def test_a_peer_gone_after_recording_bad_input_gives_its_line(tmp_path):
    env = _attempt(tmp_path, {0: None, 1: ["reward `f` failed on dataset row 5"]})
    found = peer_user_error(RuntimeError("Connection closed by peer [127.0.0.1]:1"), env, wait_s=0)
    assert found is not None and found.problems == ["reward `f` failed on dataset row 5"]


def test_other_failures_stay_failures(tmp_path):
    env = _attempt(tmp_path, {0: None, 1: None})  # the peer recorded nothing: a crash, not bad input
    assert peer_user_error(RuntimeError("Connection closed by peer"), env, wait_s=0.2) is None
    recorded = _attempt(tmp_path / "b", {0: None, 1: ["bad"]})
    assert peer_user_error(KeyError("x"), recorded) is None  # not a communication failure
    assert peer_user_error(RuntimeError("closed by peer"), {**recorded, LAUNCHER_PRINTS: "0"}) is None  # own torchrun
