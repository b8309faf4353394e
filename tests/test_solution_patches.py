"""The reference A1 fix as patches: they are what the solution tree (solutions/a1/onenode/) gives,
each part applies alone, the parts in order give exactly the full patch, part 1 alone leaves expert
parallelism off, and the public A1 tests (a1_infra/tests) fail on the starter with their teaching
messages and pass on the fixed tree."""

from __future__ import annotations

import filecmp
import re
import subprocess
import sys

import pytest
from patched_copy import FULL_PATCH, KIT_ROOT, PARTS, git_apply, patched_tree, run_in_tree, tree_env

PART_NAMES = sorted(p.stem for p in PARTS.glob("*.patch"))
PUBLIC_TESTS = ["a1_infra/tests/test_part1_moe.py", "a1_infra/tests/test_part2_ep.py",
                "a1_infra/tests/test_part3_pipeline.py"]


def _touched(patch) -> set[str]:
    return set(re.findall(r"^\+\+\+ b/(\S+)$", patch.read_text(), re.MULTILINE))


def test_stored_patches_are_what_the_solution_tree_gives():
    result = subprocess.run([sys.executable, str(KIT_ROOT / "solutions" / "a1" / "make_patches.py"), "check"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_parts_exist_and_touch_disjoint_files():
    assert {"1-moe", "2-ep"} <= set(PART_NAMES)
    seen: dict[str, str] = {}
    for name in PART_NAMES:
        for path in _touched(PARTS / f"{name}.patch"):
            assert path.startswith("starter_code/onenode/"), f"{name} touches {path}, outside starter_code/onenode"
            assert path not in seen, f"{name} and {seen[path]} both touch {path}: parts must touch disjoint files"
            seen[path] = name
    assert _touched(PARTS / "1-moe.patch") == {"starter_code/onenode/model/moe.py"}
    assert all(p.startswith("starter_code/onenode/parallel/") for p in _touched(PARTS / "2-ep.patch"))


@pytest.mark.parametrize("name", PART_NAMES)
def test_each_part_applies_alone(name, tmp_path):
    from grader.submission import pristine_tree

    tree = pristine_tree(tmp_path)
    result = git_apply(tree, PARTS / f"{name}.patch", "--check")
    assert result.returncode == 0, f"{name}.patch does not apply to the starter alone: {result.stderr}"


def test_parts_in_order_give_the_full_patch():
    by_parts, full = patched_tree(PART_NAMES), patched_tree(["submission"])

    def differences(cmp: filecmp.dircmp) -> list[str]:
        out = [f"{cmp.left}/{n}" for n in cmp.left_only + cmp.right_only + cmp.diff_files]
        return out + [d for sub in cmp.subdirs.values() for d in differences(sub)]

    # dircmp compares contents only where sizes or times differ: make it byte-for-byte.
    cmp = filecmp.dircmp(by_parts / "starter_code", full / "starter_code", ignore=["__pycache__"])
    mismatched = differences(cmp)
    for left in (by_parts / "starter_code").rglob("*.py"):
        right = full / "starter_code" / left.relative_to(by_parts / "starter_code")
        if right.exists() and left.read_bytes() != right.read_bytes():
            mismatched.append(str(left))
    assert not mismatched, f"parts applied in order differ from submission.patch: {sorted(set(mismatched))}"
    assert FULL_PATCH.read_text() == "".join((PARTS / f"{n}.patch").read_text() for n in PART_NAMES), (
        "submission.patch is not the parts concatenated in order: run solutions/a1/make_patches.py write"
    )


def expert_parallel_layers() -> int:
    """How many MoE layers `apply_expert_parallel` takes over in this tree (one gloo process)."""
    import tempfile

    import torch.distributed as dist

    from onenode.model import build_model, get_preset
    from onenode.parallel import ParallelDims, apply_expert_parallel

    with tempfile.TemporaryDirectory() as folder:
        dist.init_process_group("gloo", init_method=f"file://{folder}/store", rank=0, world_size=1)
        try:
            mesh = ParallelDims().build_mesh("cpu")
            return len(apply_expert_parallel(build_model(get_preset("tiny"), seed=0), mesh["ep"]))
        finally:
            dist.destroy_process_group()


@pytest.mark.parametrize("parts, layers", [([], 0), (["1-moe"], 0), (["2-ep"], 3), (["1-moe", "2-ep"], 3)],
                         ids=["starter", "part1", "part2", "parts1+2"])
def test_only_part2_turns_expert_parallelism_on(parts, layers):
    """The parts are graded alone: part 1's grouped experts must not make EP work by themselves."""
    assert run_in_tree(patched_tree(parts), "test_solution_patches:expert_parallel_layers") == layers


def _public_tests(parts: list[str]) -> subprocess.CompletedProcess:
    tree = patched_tree(parts)
    return subprocess.run([sys.executable, "-m", "pytest", *PUBLIC_TESTS, "-q", "-p", "no:cacheprovider"],
                          cwd=KIT_ROOT, env=tree_env(tree), capture_output=True, text=True, timeout=900)


@pytest.mark.slow
@pytest.mark.dist
def test_public_tests_fail_on_the_starter_and_teach():
    result = _public_tests([])
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-2000:]
    failed = set(re.findall(r"^FAILED \S+::(\w+)", result.stdout, re.MULTILINE))
    expected = {"test_moe_op_count_does_not_grow_with_experts", "test_moe_forward_has_no_host_sync",
                "test_ep_keeps_experts_local", "test_pp_builds_and_trains",
                "test_pp_stages_hold_every_parameter_once", "test_pp_trains_like_one_process"}
    assert failed == expected, result.stdout[-3000:]
    for message in ("aten ops with 8 experts", "host syncs", "expert weights all-gathered: about",
                    "did not build or train"):
        assert message in result.stdout, f"no {message!r} in the starter's failures:\n{result.stdout[-3000:]}"


@pytest.mark.slow
@pytest.mark.dist
def test_public_tests_pass_on_the_reference_solution():
    result = _public_tests(["submission"])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
