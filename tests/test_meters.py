"""The grader's outside meters: CPU time from /proc, and nvidia-smi's NVLink and memory readings
(parsed from text captured on a two-H200 machine, 2026-11-30)."""

import subprocess
import sys

from grader.meters import cpu_seconds, parse_gpu_memory, parse_nvlink_tx

NVLINK = """GPU 0: NVIDIA H200 (UUID: GPU-01c70b85-3043-b787-99f4-ff828a044d51)
\t Link 0: Data Tx: 584652 KiB
\t Link 0: Data Rx: 582120 KiB
\t Link 1: Data Tx: 584638 KiB
\t Link 1: Data Rx: 582134 KiB
GPU 1: NVIDIA H200 (UUID: GPU-85c898c9-d2c3-c7cc-cf40-72f4250b92a8)
\t Link 0: Data Tx: 10 KiB
\t Link 0: Data Rx: 581684 KiB
"""


BURN = "import time\nwhile time.process_time() < 0.5: pass\nprint('done', flush=True)\ntime.sleep(60)"


def test_cpu_seconds_counts_a_busy_process_and_skips_dead_ones():
    """The burner stops at 0.5 s of its own CPU time, however busy the machine is."""
    busy = subprocess.Popen([sys.executable, "-c", BURN], stdout=subprocess.PIPE, text=True)
    idle = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert busy.stdout.readline().strip() == "done"
        seconds = cpu_seconds([busy.pid, idle.pid, 2**22 + 7])
    finally:
        busy.kill()
        idle.kill()
    assert set(seconds) == {busy.pid, idle.pid}
    assert 0.45 <= seconds[busy.pid] < 5  # /proc counts whole clock ticks (10 ms)
    assert seconds[idle.pid] < 0.4


def test_nvidia_smi_readings_parse():
    assert parse_nvlink_tx(NVLINK) == 1024 * (584652 + 584638 + 10)
    assert parse_nvlink_tx("GPU 0: NVIDIA H100 PCIe\n") is None
    readings = "613, 2474\n614, 2476\n613, 2\nno, 5\n615, [N/A]\n"  # MIG shows no memory per process
    assert parse_gpu_memory(readings) == {613: 2476 * 2**20, 614: 2476 * 2**20, 615: 0}
