"""What the grader reads about a running child from outside it: resident memory, GPU memory, NVLink traffic.

None of these pass through the child: the kernel's /proc and the NVIDIA driver (through
`nvidia-smi`) answer the grader directly, so a submission cannot edit them from inside its own
process the way it can edit any counter it keeps itself. Loopback traffic of the child's own
network namespace (gloo on CPU) comes from the sandbox (`SandboxedProcess.network_bytes`).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import threading
from collections.abc import Callable, Iterable
from pathlib import Path

_NVLINK_TX = re.compile(r"Link \d+: Data Tx: (\d+) KiB")


def resident_bytes(pids: Iterable[int]) -> dict[int, int]:
    """Bytes of memory each live process has resident now (VmRSS of /proc/<pid>/status: its
    anonymous, file-backed and shared-memory pages alike, shared ones counted in every process
    that maps them)."""
    resident = {}
    for pid in pids:
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except (FileNotFoundError, ProcessLookupError):
            continue
        found = next((line for line in status.splitlines() if line.startswith("VmRSS:")), None)
        if found is not None:  # a zombie has none
            resident[pid] = int(found.split()[1]) * 1024
    return resident


class PeakResident:
    """The most memory any one of some processes has resident at any moment of a window, sampled
    from outside every `interval` seconds: a reading the processes cannot time, as a value read
    once they answer could be (a process that drops its state before it answers and takes it back
    after). Their own peak counters (VmHWM) they could reset themselves."""

    def __init__(self, pids: Callable[[], Iterable[int]], interval: float = 0.01):
        """`pids` is asked once when the window opens and once when it closes (a scan of /proc);
        between them the processes it named are sampled."""
        self.pids, self.interval = pids, interval
        self.watched: list[int] = []
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while True:
            self.peak = max(self.peak, max(resident_bytes(self.watched).values(), default=0))
            if self._stop.wait(self.interval):
                return

    def __enter__(self) -> PeakResident:
        self.watched = list(self.pids())
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, max(resident_bytes(self.pids()).values(), default=0))


def _nvidia_smi(*args: str) -> str | None:
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        result = subprocess.run(["nvidia-smi", *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return result.stdout if result.returncode == 0 else None


def parse_nvlink_tx(text: str) -> int | None:
    """Bytes sent over every NVLink of every GPU, from `nvidia-smi nvlink -gt d`; None without links."""
    counts = [int(kib) for kib in _NVLINK_TX.findall(text)]
    return 1024 * sum(counts) if counts else None


def nvlink_tx_bytes() -> int | None:
    """Bytes the machine's GPUs have sent each other over NVLink so far (None: no NVLink counters).

    The driver counts every byte NCCL moves between GPUs of the node, whichever process moved
    it, so the grading job must own the GPUs it reads (one job per node, as `cluster/` runs it)."""
    text = _nvidia_smi("nvlink", "-gt", "d")
    return parse_nvlink_tx(text) if text else None


def parse_gpu_memory(text: str) -> dict[int, int]:
    """{pid: bytes} from `nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits`."""
    memory: dict[int, int] = {}
    for line in text.splitlines():
        pid, _, mib = (part.strip() for part in line.partition(","))
        if pid.isdigit():  # memory reads "[N/A]" under MIG: the pid still holds a context
            memory[int(pid)] = memory.get(int(pid), 0) + (int(mib) * 2**20 if mib.isdigit() else 0)
    return memory


def gpu_memory_by_pid() -> dict[int, int]:
    """GPU memory each process holds now (the caching allocator keeps its peak reserved)."""
    text = _nvidia_smi("--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits")
    return parse_gpu_memory(text) if text else {}
