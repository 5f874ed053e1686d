"""The checkpoint directory reach check, one node at a time (files in a temp dir, no ranks)."""

from __future__ import annotations

import dataclasses
import os
import stat

from sparkdist._core.env import CHECKPOINT_DIR_VAR
from sparkdist._node.agent.checkpoint_reach import ReachCheck, token_path
from sparkdist._node.agent.spec import AgentSpec
from tests._helpers.specs import agent_spec


def spec_of(directory: str | None, node: int, nodes: int = 2, **kw) -> AgentSpec:
    env = {CHECKPOINT_DIR_VAR: directory} if directory else {}
    return agent_spec(
        run_id="run1",
        node_rank=node,
        num_nodes=nodes,
        master_addr="10.0.0.1",
        host=f"10.0.0.{node + 1}",
        channel_address=("10.0.0.9", 1),
        secret="s" * 64,
        start_timeout_s=60,
        extra_env=env,
        **kw,
    )


def test_nothing_to_check_on_one_node_or_without_a_directory(tmp_path):
    assert ReachCheck.of(spec_of(str(tmp_path), 0, nodes=1)) is None
    assert ReachCheck.of(spec_of(None, 0)) is None


def test_a_shared_directory_passes_and_node_0_cleans_up(tmp_path):
    writer = ReachCheck.of(spec_of(str(tmp_path / "ckpt"), 0))
    reader = ReachCheck.of(spec_of(str(tmp_path / "ckpt"), 1))
    assert writer is not None and reader is not None
    assert writer.before_hello() is None
    path = token_path(str(tmp_path / "ckpt"), writer.spec)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert "s" * 64 not in open(path).read()  # the secret itself never reaches the file
    assert reader.at_rendezvous() is None
    writer.close()
    assert not os.path.exists(path)


def test_a_directory_node_1_does_not_share_is_refused_with_the_node_and_the_fix(tmp_path):
    ReachCheck(spec_of(None, 0), str(tmp_path / "host0")).before_hello()
    reason = ReachCheck(spec_of(None, 1), str(tmp_path / "host1")).at_rendezvous()
    assert reason is not None
    assert f"checkpoint_dir {tmp_path / 'host1'} on node 1 (host 10.0.0.2)" in reason
    assert "does not see what node 0 wrote there" in reason
    assert "storage every node mounts at the same path" in reason


def test_a_stale_token_of_another_attempt_does_not_pass(tmp_path):
    directory = str(tmp_path)
    ReachCheck(spec_of(None, 0), directory).before_hello()
    later = spec_of(None, 1, restart_count=1)
    first_path = token_path(directory, spec_of(None, 0))
    os.replace(first_path, token_path(directory, later))  # the file, under the new name
    reason = ReachCheck(later, directory).at_rendezvous()
    assert reason is not None and "another file than node 0 wrote" in reason


def test_node_0_that_cannot_write_refuses(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    reason = ReachCheck(dataclasses.replace(spec_of(None, 0)), str(blocker / "x")).before_hello()
    assert reason is not None and "node 0 cannot write there" in reason
