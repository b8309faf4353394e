"""Multi-node A2 on torchrun, on this machine: `cluster/train_torchrun.sh` started twice as two
"nodes" (`--nnodes 2`, one process each, c10d rendezvous on 127.0.0.1, gloo), the commands that
`cluster/train_multinode.sbatch` runs on each node. The two-node run trains the tiny recipe to
the same losses, data order and weights as one node of the same world size, and after one node
is killed a relaunch resumes from the last checkpoint and still ends there. SLURM's variables
reach torchrun's arguments as the sbatch script maps them (a dry run with `srun`, `scontrol`
and python stubbed)."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from dist_utils import run_distributed

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "a2_pretrain" / "recipes" / "tiny.yaml"
# 8 steps of 4 x 32 tokens, a checkpoint every 2: the kill lands between checkpoints
SMALL = {"train.seq_len": 32, "train.global_batch_size": 4, "train.micro_batch_size": 2,
         "train.token_budget": 1024, "checkpoint.every_steps": 2, "checkpoint.keep_last": 0,
         "eval.every_steps": 0, "eval.batches": 1, "log.every_steps": 1, "log.progress_bar": False}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_nodes(out: Path, run_id: str) -> list[subprocess.Popen]:
    """Both nodes of one launch: `cluster/train_torchrun.sh` twice."""
    port = _free_port()
    sets = [arg for key, value in SMALL.items() for arg in ("--set", f"{key}={str(value).lower()}")]
    nodes = []
    for node_rank in range(2):
        env = {**os.environ, "PYTHON": sys.executable, "NNODES": "2", "NODE_RANK": str(node_rank), "NPROC": "1",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RDZV_ID": run_id, "OMP_NUM_THREADS": "1"}
        log = (out.parent / f"{out.name}-{run_id}-node{node_rank}.log").open("w")
        nodes.append(subprocess.Popen(["bash", str(ROOT / "cluster" / "train_torchrun.sh"), str(TINY), "--out",
                                       str(out), *sets], env=env, stdout=log, stderr=subprocess.STDOUT,
                                      ))
    return nodes


def _tree(pid: int) -> list[int]:
    """`pid` and every process under it (torchrun starts its workers in sessions of their own, so
    its process group is not the whole node)."""
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    tree, todo = [], [pid]
    while todo:
        tree.append(todo.pop())
        todo.extend(parents.get(tree[-1], []))
    return tree


def _kill(node: subprocess.Popen) -> None:
    for pid in _tree(node.pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    node.wait()


def _wait(nodes: list[subprocess.Popen], timeout: float = 300) -> list[int]:
    deadline = time.monotonic() + timeout
    try:
        return [node.wait(timeout=max(deadline - time.monotonic(), 1)) for node in nodes]
    finally:
        for node in nodes:
            if node.poll() is None:
                _kill(node)


def _one_node_run(recipe_path: str, overrides: dict, out: str) -> dict:
    from onenode.train.recipe import load_recipe
    from onenode.train.trainer import Trainer

    return Trainer(load_recipe(recipe_path, overrides), out, resume=None).fit()


def _last_losses(out: Path) -> dict[int, float]:
    """Each step's loss as metrics.jsonl last logged it (a resumed run logs some steps again)."""
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {r["step"]: r["loss"] for r in records if "loss" in r}


def _final_weights(out: Path) -> str:
    last = max((out / "checkpoints").glob("step_*/meta.json"))
    return json.loads(last.read_text())["weights_sha256"]


@pytest.mark.slow
@pytest.mark.dist
def test_two_torchrun_nodes_train_as_one_node_and_resume_after_a_node_dies(tmp_path):
    one = tmp_path / "one_node"
    reference = run_distributed(_one_node_run, world_size=2, args=(str(TINY), SMALL, str(one)))[0]
    assert reference["status"] == "finished" and reference["steps"] == 8

    two = tmp_path / "two_nodes"
    nodes = _start_nodes(two, "first")
    first_checkpoint = two / "checkpoints" / "step_00000002" / "meta.json"
    deadline = time.monotonic() + 300
    while not first_checkpoint.is_file() and all(n.poll() is None for n in nodes) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert first_checkpoint.is_file(), "the two-node run wrote no checkpoint"
    _kill(nodes[1])  # node 1 dies: its torchrun and its trainer
    codes = _wait(nodes)
    assert codes[0] != 0, "node 0 went on without node 1"
    manifest = two / "run_manifest.json"
    assert not manifest.is_file() or json.loads(manifest.read_text())["status"] != "finished"

    assert _wait(_start_nodes(two, "second")) == [0, 0]  # the relaunch resumes from the last checkpoint
    resumed = json.loads(manifest.read_text())
    assert resumed["status"] == "finished"
    assert resumed["steps"] == reference["steps"] and resumed["tokens_seen"] == reference["tokens_seen"]
    assert resumed["data_digest"] == reference["data_digest"]  # the same batches on the same ranks
    assert _last_losses(two) == _last_losses(one)  # bitwise: gloo on CPU sums in the same order
    assert _final_weights(two) == _final_weights(one)


def test_the_sbatch_script_maps_slurm_onto_torchrun(tmp_path):
    """`sbatch --nodes 2` on nodes node-a and node-b: each node's torchrun gets its node rank, the
    first node as rendezvous endpoint, the job id as rendezvous id and the GPUs on the node."""
    bin_dir, submit = tmp_path / "bin", tmp_path / "submit"
    bin_dir.mkdir()
    submit.mkdir()
    (submit / "cluster").symlink_to(ROOT / "cluster")
    calls = tmp_path / "calls.jsonl"
    stubs = {
        # srun: run the task once per node, with that node's SLURM_NODEID
        "srun": '#!/usr/bin/env bash\nwhile [[ "$1" == --* ]]; do shift; done\n'
                'for id in $(seq 0 $((SLURM_JOB_NUM_NODES - 1))); do SLURM_NODEID=$id "$@" || exit $?; done\n',
        "scontrol": '#!/usr/bin/env bash\n'
                    '[ "$1 $2 $3" = "show hostnames node-[a-b]" ] && printf "node-a\\nnode-b\\n"\n',
        "python": f'#!/usr/bin/env bash\nexec {sys.executable} -c "import json, sys; '
                  f"print(json.dumps(sys.argv[1:]))\" \"$@\" >> {calls}\n",
    }
    for name, text in stubs.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "PYTHON": str(bin_dir / "python"),
           "SLURM_SUBMIT_DIR": str(submit), "SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_NODELIST": "node-[a-b]",
           "SLURM_JOB_ID": "4242", "SLURM_GPUS_ON_NODE": "8"}
    env.pop("NPROC", None)
    env.pop("MASTER_PORT", None)
    sbatch = ROOT / "cluster" / "train_multinode.sbatch"
    result = subprocess.run(["bash", str(sbatch), "recipe.yaml", "--out", "runs/x"], env=env, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    launched = [json.loads(line) for line in calls.read_text().splitlines()]
    assert launched == [
        ["-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(rank), "--rdzv-backend", "c10d",
         "--rdzv-endpoint", "node-a:29500", "--rdzv-id", "4242", "--nproc-per-node", "8",
         "-m", "onenode.cli", "train", "recipe.yaml", "--out", "runs/x"] for rank in range(2)]
    assert (submit / "logs").is_dir()  # where #SBATCH --output writes
