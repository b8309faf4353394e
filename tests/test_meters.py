"""The grader's outside meters: CPU time from /proc, and nvidia-smi's NVLink and memory readings
(parsed from text captured on a two-H200 machine, 2026-11-30)."""

import subprocess
import sys

from grader.meters import parse_gpu_memory, parse_nvlink_tx, resident_bytes

NVLINK = """GPU 0: NVIDIA H200 (UUID: GPU-01c70b85-3043-b787-99f4-ff828a044d51)
\t Link 0: Data Tx: 584652 KiB
\t Link 0: Data Rx: 582120 KiB
\t Link 1: Data Tx: 584638 KiB
\t Link 1: Data Rx: 582134 KiB
GPU 1: NVIDIA H200 (UUID: GPU-85c898c9-d2c3-c7cc-cf40-72f4250b92a8)
\t Link 0: Data Tx: 10 KiB
\t Link 0: Data Rx: 581684 KiB
"""


HOLD = "b = bytearray(200 * 2**20)\nprint('held', flush=True)\nimport time; time.sleep(60)"


def test_resident_bytes_sees_memory_a_process_holds_and_skips_dead_ones():
    """A process that filled 200 MiB holds about that much more than an idle interpreter."""
    holder = subprocess.Popen([sys.executable, "-c", HOLD], stdout=subprocess.PIPE, text=True)
    idle = subprocess.Popen([sys.executable, "-c", "import time; print('idle', flush=True); time.sleep(60)"],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held" and idle.stdout.readline().strip() == "idle"
        resident = resident_bytes([holder.pid, idle.pid, 2**22 + 7])
    finally:
        holder.kill()
        idle.kill()
    assert set(resident) == {holder.pid, idle.pid}
    assert resident[holder.pid] - resident[idle.pid] >= 190 * 2**20  # the two interpreters differ by kilobytes


def test_nvidia_smi_readings_parse():
    assert parse_nvlink_tx(NVLINK) == 1024 * (584652 + 584638 + 10)
    assert parse_nvlink_tx("GPU 0: NVIDIA H100 PCIe\n") is None
    readings = "613, 2474\n614, 2476\n613, 2\nno, 5\n615, [N/A]\n"  # MIG shows no memory per process
    assert parse_gpu_memory(readings) == {613: 2476 * 2**20, 614: 2476 * 2**20, 615: 0}
