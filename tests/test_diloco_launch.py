"""DiLoCo across nodes through the cluster launcher: `cluster/train_diloco.sh` on two "nodes" of this
machine (two replica groups, one process each, gloo, the lighthouse started by group 0's script), and
`cluster/train_multinode.sbatch` with DILOCO=1 mapping SLURM onto one replica group per node (a dry
run with `srun`, `scontrol` and python stubbed)."""

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "a2_pretrain" / "recipes" / "tiny.yaml"
# 4 steps of 4 x 32 tokens over two groups, a sync (and a checkpoint) every 2
SMALL = {"train.seq_len": 32, "train.global_batch_size": 4, "train.micro_batch_size": 0, "train.token_budget": 512,
         "checkpoint.every_steps": 2, "checkpoint.keep_last": 0, "checkpoint.export_hf": False,
         "eval.every_steps": 0, "eval.batches": 1, "log.every_steps": 1, "log.progress_bar": False,
         "log.tensorboard": False, "parallel.diloco.inner_steps": 2, "parallel.diloco.replicas": 2}


def _sets(overrides: dict) -> list[str]:
    return [arg for key, value in overrides.items() for arg in ("--set", f"{key}={str(value).lower()}")]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(tmp_path: Path, out: Path, overrides: dict, env: dict | None = None) -> tuple[list[int], list[str]]:
    """Two "nodes" of `cluster/train_diloco.sh`, one replica group each, to the end: their exit codes
    and logs."""
    port, nodes = _free_port(), []
    for replica in range(2):
        node_env = {**os.environ, **(env or {}), "PYTHON": sys.executable, "NNODES": "2", "NODE_RANK": str(replica),
                    "NPROC": "1", "LIGHTHOUSE_HOST": "localhost", "LIGHTHOUSE_PORT": str(port), "OMP_NUM_THREADS": "1"}
        for key in ("REPLICA_GROUP_ID", "TORCHFT_LIGHTHOUSE", "MASTER_ADDR", "MASTER_PORT"):
            node_env.pop(key, None)
        log = (tmp_path / f"node{replica}.log").open("w")
        nodes.append(subprocess.Popen(["bash", str(ROOT / "cluster" / "train_diloco.sh"), str(TINY), "--out",
                                       str(out), *_sets(overrides)], env=node_env, stdout=log,
                                      stderr=subprocess.STDOUT))
    try:
        codes = [node.wait(timeout=300) for node in nodes]
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
    return codes, [(tmp_path / f"node{r}.log").read_text() for r in range(2)]


@pytest.mark.slow
@pytest.mark.dist
def test_two_nodes_of_the_launcher_train_one_diloco_run(tmp_path):
    """Both groups finish the budget, each on its own half of the tokens, and end with the same model
    (the last sync's): the lighthouse came up on group 0's node and the groups met there."""
    pytest.importorskip("torchft", reason="DiLoCo runs through torchft: pip install 'onenode[diloco]'")
    out = tmp_path / "run"
    codes, logs = _launch(tmp_path, out, SMALL)
    assert codes == [0, 0], logs[0][-3000:] + logs[1][-3000:]
    assert "torchft lighthouse at" in logs[0] and "torchft lighthouse at" not in logs[1]
    folders = [out, out / "replica_1"]
    manifests = [json.loads((folder / "run_manifest.json").read_text()) for folder in folders]
    for replica, manifest in enumerate(manifests):
        assert manifest["status"] == "finished" and manifest["steps"] == 4
        assert manifest["tokens_seen"] == manifest["data_tokens_served"] == 512  # both groups' tokens
        assert manifest["diloco"] == {"replica_group": replica}
    losses = [[json.loads(line)["loss"] for line in (folder / "metrics.jsonl").read_text().splitlines()
               if '"loss"' in line] for folder in folders]
    assert losses[0] != losses[1]  # each group its own slice of the data
    weights = [json.loads((folder / "checkpoints" / "step_00000004" / "meta.json").read_text())["weights_sha256"]
               for folder in folders]
    assert weights[0] == weights[1]  # the same model after the last sync


# -- the grader's verification of a DiLoCo run -----------------------------------------------------


def _as_one_group(sub: Path) -> None:
    """Group 0's files of a DiLoCo run handed in as a run of one group: replica_1/ gone, the recipe's
    DiLoCo off and its global batch and budget group 0's share, every file counting group 0's tokens
    alone and every checkpoint's recipe hash updated. Each file agrees with the others; half the
    tokens the run trained on go uncounted."""
    import yaml

    shutil.rmtree(sub / "replica_1")
    recipe = yaml.safe_load((sub / "recipe.yaml").read_text())
    recipe["parallel"]["diloco"]["inner_steps"] = 0
    recipe["train"]["global_batch_size"] //= 2
    recipe["train"]["token_budget"] //= 2
    (sub / "recipe.yaml").write_text(yaml.safe_dump(recipe, sort_keys=False))
    from onenode.train.recipe import load_recipe

    claimed = load_recipe(sub / "recipe.yaml")
    for meta in (sub / "checkpoints").glob("step_*/meta.json"):
        _edit(meta, lambda m: m.update(training_sha256=claimed.training_sha256))
    for manifest in (sub / "run_manifest.json", sub / "final" / "run_manifest.json"):
        _edit(manifest, lambda m: (m.pop("diloco"), m.update(
            recipe=claimed.to_dict(), token_budget=claimed.train.token_budget,
            tokens_per_step=claimed.tokens_per_step, tokens_seen=m["steps"] * claimed.tokens_per_step,
            data_tokens_served=m["steps"] * claimed.tokens_per_step)))
    records = [json.loads(line) for line in (sub / "metrics.jsonl").read_text().splitlines()]
    for record in records:
        if "tokens" in record:
            record["tokens"] = record["step"] * claimed.tokens_per_step
    (sub / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def _edit(path: Path, change) -> None:
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


@pytest.mark.dist
@pytest.mark.slow
def test_the_grader_verifies_a_diloco_run_and_one_hiding_a_group_earns_nothing(tmp_path):
    """A DiLoCo run (two groups, H = 2, a checkpoint at every sync), handed in as `onenode pack a2`
    copies it (replica_1/ with it), passes every check of the grader's verification: the audit of
    both groups' chains, each group examined on its own slice, the movement bound grown by the
    outer step, the drawn spans replayed with both groups in the sandbox on the grader's A2 stack.
    A trainer state that names another step than its checkpoint's (the step a resume would train
    from: it picks the learning rate) fails the optimizer-state check, in group 0 too. Without
    replica_1/ the audit refuses it in one line. Handed in as group 0's run alone, every
    file rewritten to count its half of the tokens, it is not verified: the audit passes and the
    replay of its first span (a plain run's steps, no outer step) does not give its chain back."""
    pytest.importorskip("torchft", reason="DiLoCo runs through torchft: pip install 'onenode[diloco]'")
    from grader.a2.intake import load_submission
    from grader.a2.job import a2_stack, new_job
    from grader.a2.rubric import load_rubric
    from grader.a2.scoring import verify
    from onenode.pack import copy_a2, pack_a2
    from onenode.verify.audit import audit_run

    run = tmp_path / "run"  # 20 steps, 10 spans: the cpu-tiny profile replays the first, the last and one other
    codes, logs = _launch(tmp_path, run, {**SMALL, "train.token_budget": 20 * 128, "checkpoint.export_hf": True},
                          {"PYTHONPATH": str(a2_stack() / "starter_code")})  # as the grader's reference runs train
    assert codes == [0, 0], logs[0][-3000:] + logs[1][-3000:]
    report = tmp_path / "report.ipynb"
    report.write_text('{"cells": [], "metadata": {}, "nbformat": 4, "nbformat_minor": 5}')
    job = new_job(load_rubric(), "cpu-tiny", tmp_path / "job", seed=0)

    def checked(sub: Path) -> dict:
        logs = tmp_path / f"{sub.name}-logs"
        logs.mkdir()
        checks, _ = verify(job, load_submission(sub, notebook=False), logs)
        assert all("\n" not in check.detail for check in checks)
        return {check.name: check for check in checks}

    packed = pack_a2(run, tmp_path / "honest", report)  # as a group hands it in
    assert "(with DiLoCo's other replica groups: replica_1)" in packed, packed
    honest = tmp_path / "honest"
    checks = checked(honest)
    assert all(check.ok for check in checks.values()), [c.detail for c in checks.values() if not c.ok]
    assert checks["replica groups"].detail.startswith("2 DiLoCo replica groups (a sync every 2 steps)")
    assert "bit for bit" in checks["replay"].detail and "in each of the 2 replica groups" in checks["weights"].detail

    steered = copy_a2(run, tmp_path / "steered", report, None)  # the red team's lr steering: the stored step
    for group in (steered, steered / "replica_1"):  # one step back, so that the next window trains a step earlier
        state_file = group / "checkpoints" / "step_00000010" / "trainer_state_rank0.pt"
        state = torch.load(state_file, weights_only=True)
        state["step"] = 9
        torch.save(state, state_file)
    checks = checked(steered)
    assert not checks["optimizer state"].ok and "step_00000010 stores" in checks["optimizer state"].detail and \
        "its trainer state says step 9 at the chain's step 10" in checks["optimizer state"].detail, \
        checks["optimizer state"].detail

    missing = copy_a2(run, tmp_path / "missing", report, None)
    shutil.rmtree(missing / "replica_1")
    failed = {c.name: c.detail for c in audit_run(load_submission(missing, notebook=False), job.profile.token_budget)
              if not c.ok}
    assert list(failed) == ["replica groups"] and "it holds none: submit every group's folder" in \
        failed["replica groups"], failed

    hidden = copy_a2(run, tmp_path / "hidden", report, None)
    _as_one_group(hidden)
    assert not [c.detail for c in audit_run(load_submission(hidden, notebook=False), job.profile.token_budget)
                if not c.ok]
    checks = checked(hidden)
    assert not checks["replay"].ok and "does not give step_00000002 back" in checks["replay"].detail, \
        checks["replay"].detail


def _stub_cluster(tmp_path: Path, check_line: str) -> tuple[dict, Path]:
    """`srun` running each node's task in turn, `scontrol` naming node-a and node-b, and a python that
    prints `check_line` for `onenode train --check` and otherwise writes what it was asked to run."""
    bin_dir, submit = tmp_path / "bin", tmp_path / "submit"
    bin_dir.mkdir()
    submit.mkdir()
    (submit / "cluster").symlink_to(ROOT / "cluster")
    calls = tmp_path / "calls.jsonl"
    names = "('REPLICA_GROUP_ID', 'TORCHFT_LIGHTHOUSE', 'MASTER_ADDR')"
    record = (f'{sys.executable} -c "import json, os, sys; print(json.dumps({{\'argv\': sys.argv[1:], '
              f"'env': {{k: os.environ.get(k) for k in {names}}}}}))\" "
              f'"$@" >> {calls}')
    stubs = {
        "srun": '#!/usr/bin/env bash\nwhile [[ "$1" == --* ]]; do shift; done\n'
                'for id in $(seq 0 $((SLURM_JOB_NUM_NODES - 1))); do SLURM_NODEID=$id "$@" || exit $?; done\n',
        "scontrol": '#!/usr/bin/env bash\n'
                    '[ "$1 $2 $3" = "show hostnames node-[a-b]" ] && printf "node-a\\nnode-b\\n"\n',
        # the lighthouse (python -c ... &) records itself and stays up until the script ends it; group 0's
        # torchrun waits for that record, so the script cannot end it first
        "python": f'#!/usr/bin/env bash\ncase " $* " in *" --check "*) echo "{check_line}"; exit 0;; esac\n'
                  f'if [ "${{REPLICA_GROUP_ID:-}}" = 0 ]; then for i in $(seq 100); do\n'
                  f'  grep -q \'"-c"\' {calls} 2>/dev/null && break; sleep 0.1; done; fi\n'
                  f'{record}\n[ "$1" = -c ] && exec sleep 60\nexit 0\n',
    }
    for name, text in stubs.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "PYTHON": str(bin_dir / "python"),
           "SLURM_SUBMIT_DIR": str(submit), "SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_NODELIST": "node-[a-b]",
           "SLURM_JOB_ID": "4242", "SLURM_GPUS_ON_NODE": "8", "DILOCO": "1"}
    for key in ("NPROC", "MASTER_PORT", "LIGHTHOUSE_PORT", "TORCHFT_LIGHTHOUSE", "REPLICA_GROUP_ID"):
        env.pop(key, None)
    return env, calls


def _sbatch(env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(ROOT / "cluster" / "train_multinode.sbatch"), "recipe.yaml", "--out", "runs/x"],
                          env=env, capture_output=True, text=True, timeout=60)


def test_the_sbatch_script_runs_one_replica_group_per_node_and_the_lighthouse_on_the_first(tmp_path):
    env, calls = _stub_cluster(tmp_path, "DiLoCo: 2 replica groups, a sync every 32 inner steps")
    result = _sbatch(env)
    assert result.returncode == 0, result.stderr
    launched = [json.loads(line) for line in calls.read_text().splitlines()]
    lighthouses = [call for call in launched if call["argv"][0] == "-c"]
    assert [call["argv"][2:] for call in lighthouses] == [["[::]:29510", "2"]]  # once, for 2 replica groups
    assert lighthouses[0]["env"]["REPLICA_GROUP_ID"] is None  # started before this node's group
    groups = [call for call in launched if call["argv"][0] == "-m"]
    assert groups == [
        {"argv": ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "8",
                  "-m", "onenode.cli", "train", "recipe.yaml", "--out", "runs/x"],
         "env": {"REPLICA_GROUP_ID": str(rank), "TORCHFT_LIGHTHOUSE": "http://node-a:29510", "MASTER_ADDR": None}}
        for rank in range(2)]


@pytest.mark.parametrize("check_line, nodes, line", [
    ("", "2", "error: recipe.yaml trains without DiLoCo: add --set parallel.diloco.inner_steps=H"),
    ("DiLoCo: 3 replica groups, a sync every 32 inner steps", "2",
     "error: 2 nodes for parallel.diloco.replicas 3: launch one node per replica group (sbatch --nodes 3)"),
])
def test_a_recipe_that_does_not_fit_the_nodes_is_one_line_before_anything_starts(tmp_path, check_line, nodes, line):
    env, calls = _stub_cluster(tmp_path, check_line)
    result = _sbatch({**env, "SLURM_JOB_NUM_NODES": nodes})
    assert result.returncode == 2
    assert result.stderr.startswith(line) and result.stderr.count("\n") == 1
    assert not calls.exists()  # no lighthouse, no training


def test_check_prints_the_diloco_line_the_launcher_reads():
    from onenode.train.cli import describe
    from onenode.train.recipe import load_recipe

    assert "DiLoCo" not in describe(load_recipe(TINY))
    plan = describe(load_recipe(TINY, {"parallel.diloco.inner_steps": 4, "parallel.diloco.replicas": 2}))
    assert plan.splitlines()[-1].startswith("DiLoCo: 2 replica groups, a sync every 4 inner steps")


def test_a_group_advertises_a_store_the_other_nodes_can_reach(monkeypatch):
    """torchrun on one node and a process on its own name their store localhost; torchft hands the
    first group's store to every group, so the name it gets is this machine's (where it resolves)."""
    from onenode.parallel.diloco import store_host

    monkeypatch.setattr(socket, "gethostname", lambda: "node-a")
    monkeypatch.setattr(socket, "getaddrinfo", lambda host, port: [])
    assert [store_host(addr) for addr in ("localhost", "127.0.0.1", "::1")] == ["node-a"] * 3
    assert store_host("node-b") == "node-b"

    def unresolved(host, port):
        raise socket.gaierror(-2, "Name or service not known")

    monkeypatch.setattr(socket, "getaddrinfo", unresolved)
    assert store_host("localhost") == "localhost"
