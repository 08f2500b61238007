"""GPU occupancy: who holds memory on which GPU, and which systemd unit or container owns it.

Reads NVML (nvidia-ml-py) where it works, else the CSV of `nvidia-smi --query-gpu` and
`--query-compute-apps`. With no driver or no GPU it says so and returns nothing; callers
carry on. The owner of a process comes from `/proc/PID/cgroup` (cgroup v1 or v2), so that
the report can print the exact command that stops it and keeps it from starting at boot.

The driver reports PIDs as the host numbers them. Inside a container or a Kubernetes pod
they are another PID namespace's: /proc/PID here is missing or another process. A process
whose /proc/PID here does not run what the driver names is said to live elsewhere; nothing
read from this machine's /proc/PID is used for it, and no command that stops it is given
(never `kill` of a PID whose command does not match, never of PID 1).
"""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from eyas.errors import EyasError

MIB = 1 << 20


@dataclass
class GpuProcess:
    pid: int
    gpu_index: int
    used_bytes: int
    name: str
    cmdline: str = ""
    unit: str | None = None
    user_unit: bool = False
    container: str | None = None
    container_runtime: str | None = None
    here: bool = True
    """Whether /proc/PID on this machine is the process the driver names."""
    here_is: str = ""
    """What PID is on this machine where it is another process ('' where there is none)."""

    def stop_command(self) -> str | None:
        """The command that stops it (and keeps it from starting at boot), or None where
        this machine cannot stop it safely."""
        if not self.here:
            return None
        if self.container:
            rt = self.container_runtime or "docker"
            return (
                f"{rt} update --restart=no {self.container[:12]} && {rt} stop {self.container[:12]}"
            )
        if self.unit:
            return f"systemctl {'--user ' if self.user_unit else ''}disable --now {self.unit}"
        return f"kill {self.pid}" if self.pid > 1 else None

    def owner(self) -> str:
        if not self.here:
            now = (
                f"PID {self.pid} here is {self.here_is}"
                if self.here_is
                else f"no PID {self.pid} here"
            )
            return f"another PID namespace or container ({now})"
        if self.container:
            return f"container {self.container[:12]} ({self.container_runtime or 'docker'})"
        if self.unit:
            return f"{'user ' if self.user_unit else ''}systemd unit {self.unit}"
        return "started by hand: no systemd unit or container"


@dataclass
class Gpu:
    index: int
    uuid: str
    name: str
    used_bytes: int
    total_bytes: int
    utilization: int | None
    processes: list[GpuProcess] = field(default_factory=list)


@dataclass
class GpuReport:
    gpus: list[Gpu]
    source: str  # "nvml", "nvidia-smi" or "none"
    note: str = ""


def _int(s: str) -> int | None:
    s = s.strip()
    return int(float(s)) if re.fullmatch(r"-?\d+(\.\d+)?", s) else None


def owner_from_cgroup(text: str) -> tuple[str | None, bool, str | None, str | None]:
    """(unit, is_user_unit, container_id, runtime) from the contents of /proc/PID/cgroup."""
    paths = [line.split(":", 2)[2] for line in text.splitlines() if line.count(":") >= 2]
    # cgroup v2 has one line "0::/path"; in v1 the name=systemd or pids line carries the unit.
    for path in sorted(paths, key=lambda p: -len(p)):
        m = re.search(r"(docker|libpod|cri-containerd|crio)-([0-9a-f]{12,64})\.scope", path)
        if m:
            rt = {"libpod": "podman", "cri-containerd": "crictl", "crio": "crictl"}.get(
                m.group(1), "docker"
            )
            return None, False, m.group(2), rt
        m = re.search(r"/(docker|kubepods[^/]*)/(?:.*/)?([0-9a-f]{64})", path)
        if m:
            return None, False, m.group(2), "docker" if m.group(1) == "docker" else "crictl"
    for path in paths:
        parts = [p for p in path.split("/") if p]
        units = [p for p in parts if p.endswith(".service")]
        if not units:
            continue
        if "user.slice" in parts:
            inner = [u for u in units if not u.startswith("user@")]
            if inner:
                return inner[-1], True, None, None
            continue
        return units[-1], False, None, None
    return None, False, None, None


def same_process(name: str, cmdline: str, comm: str = "") -> bool:
    """Whether a process the driver names `name` can be the one whose /proc says `cmdline`
    (and `comm`): the same program (the basename of its path or of argv[0]), or the name a
    process gave itself. An unnamed one (NVML without names) is taken as it is."""
    if not name:
        return True
    base = name.rsplit("/", 1)[-1]
    argv0 = cmdline.split(" ", 1)[0].rsplit("/", 1)[-1] if cmdline else ""
    return base in (argv0, comm) or base[:15] == comm or (bool(cmdline) and name in cmdline)


def describe_process(
    pid: int, proc_root: Path = Path("/proc")
) -> tuple[str, str | None, bool, str | None, str | None]:
    """(cmdline, unit, user_unit, container, runtime) for a PID; blanks where unreadable."""
    base = proc_root / str(pid)
    try:
        cmd = (base / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        cmd = ""
    try:
        unit, user, cont, rt = owner_from_cgroup((base / "cgroup").read_text())
    except OSError:
        unit, user, cont, rt = None, False, None, None
    return cmd, unit, user, cont, rt


def _from_nvml() -> list[Gpu] | None:
    try:
        import pynvml  # type: ignore[import-not-found]
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except Exception:
        return None
    try:
        gpus = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            mem = pynvml.nvmlDeviceGetMemoryInfo(h)
            try:
                util = pynvml.nvmlDeviceGetUtilizationRates(h).gpu
            except Exception:
                util = None
            name = pynvml.nvmlDeviceGetName(h)
            g = Gpu(
                i,
                pynvml.nvmlDeviceGetUUID(h),
                name if isinstance(name, str) else name.decode(),
                mem.used,
                mem.total,
                util,
            )
            for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h):
                try:
                    pname = pynvml.nvmlSystemGetProcessName(p.pid)
                    pname = pname if isinstance(pname, str) else pname.decode(errors="replace")
                except Exception:
                    pname = ""
                g.processes.append(GpuProcess(p.pid, i, p.usedGpuMemory or 0, pname))
            gpus.append(g)
        return gpus
    finally:
        pynvml.nvmlShutdown()


def _run_smi(args: list[str]) -> tuple[int, str]:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        raise FileNotFoundError("nvidia-smi")
    p = subprocess.run([exe, *args], capture_output=True, text=True, timeout=30)
    return p.returncode, (p.stdout or "") + (p.stderr if p.returncode else "")


def parse_query_gpu(csv: str) -> list[Gpu]:
    """Rows of `--query-gpu=index,uuid,name,memory.used,memory.total,utilization.gpu --format=csv,noheader,nounits`."""
    gpus = []
    for line in csv.splitlines():
        f = [x.strip() for x in line.split(",")]
        if len(f) < 6 or _int(f[0]) is None:
            continue
        gpus.append(
            Gpu(int(f[0]), f[1], f[2], (_int(f[3]) or 0) * MIB, (_int(f[4]) or 0) * MIB, _int(f[5]))
        )
    return gpus


def parse_query_apps(csv: str, uuid_to_index: dict[str, int]) -> list[GpuProcess]:
    """Rows of `--query-compute-apps=gpu_uuid,pid,used_memory,process_name --format=csv,noheader,nounits`."""
    procs = []
    for line in csv.splitlines():
        f = [x.strip() for x in line.split(",", 3)]
        if len(f) < 3 or _int(f[1]) is None:
            continue
        procs.append(
            GpuProcess(
                int(f[1]),
                uuid_to_index.get(f[0], -1),
                (_int(f[2]) or 0) * MIB,
                f[3] if len(f) > 3 else "",
            )
        )
    return procs


def query_gpus(proc_root: Path | None = None) -> GpuReport:
    """All GPUs with their processes; `proc_root` (or $EYAS_PROC_ROOT) replays a captured /proc."""
    import os

    proc_root = proc_root or Path(os.environ.get("EYAS_PROC_ROOT", "/proc"))
    gpus, source = _from_nvml(), "nvml"
    if gpus is None:
        source = "nvidia-smi"
        try:
            rc, out = _run_smi(
                [
                    "--query-gpu=index,uuid,name,memory.used,memory.total,utilization.gpu",
                    "--format=csv,noheader,nounits",
                ]
            )
        except FileNotFoundError:
            return GpuReport(
                [],
                "none",
                "no NVIDIA driver found (no NVML, no nvidia-smi on PATH): no GPUs to check",
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            return GpuReport([], "none", f"nvidia-smi could not run: {exc}")
        if rc != 0:
            first = out.strip().splitlines()[0] if out.strip() else f"exit code {rc}"
            return GpuReport([], "none", f"nvidia-smi failed: {first}")
        gpus = parse_query_gpu(out)
        rc, out = _run_smi(
            [
                "--query-compute-apps=gpu_uuid,pid,used_memory,process_name",
                "--format=csv,noheader,nounits",
            ]
        )
        if rc == 0:
            by_uuid = {g.uuid: g.index for g in gpus}
            for p in parse_query_apps(out, by_uuid):
                if 0 <= p.gpu_index < len(gpus):
                    gpus[p.gpu_index].processes.append(p)
    for g in gpus:
        for p in g.processes:
            _place(p, proc_root)
    if not gpus:
        return GpuReport([], source, "the driver reports no GPUs")
    return GpuReport(gpus, source)


def _place(p: GpuProcess, proc_root: Path) -> None:
    """Fill in what this machine's /proc says of p, where it is p (else mark it elsewhere)."""
    cmd, unit, user, cont, rt = describe_process(p.pid, proc_root)
    try:
        comm = (proc_root / str(p.pid) / "comm").read_text().strip()
    except OSError:
        comm = ""
    exists = (proc_root / str(p.pid)).is_dir()
    if not exists or p.pid == 1 or not same_process(p.name, cmd, comm):
        p.here, p.here_is, p.cmdline = False, (cmd or comm) if exists else "", p.name
        return
    p.cmdline, p.unit, p.user_unit, p.container, p.container_runtime = (
        cmd or p.name,
        unit,
        user,
        cont,
        rt,
    )


class GpuBusy(EyasError, RuntimeError):
    """Another process holds memory on a GPU this run needs."""


def stop_advice(p: GpuProcess) -> str:
    """One line on how to stop p: its command, or where it must be stopped."""
    if cmd := p.stop_command():
        return f"stop it with: {cmd}"
    return "stop it where it runs (its host or container): this machine cannot stop it"


def gpus_for_device(device: str, count: int, use: int | None = None) -> list[int]:
    """Indices (as nvidia-smi numbers them) that `--device` will use; [] for CPU. `use`:
    the first that many visible GPUs (an engine with tensor parallelism)."""
    import os

    if device == "cpu":
        return []
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    phys = (
        [int(x) for x in visible.split(",") if x.strip().isdigit()]
        if visible
        else list(range(count))
    )
    if use is not None and device in ("auto", "cuda"):
        return phys[:use]
    if device in ("auto", "multi"):
        return phys if device == "multi" else phys[:1]
    if device == "cuda":
        return phys[:1]
    m = re.fullmatch(r"cuda:(\d+)", device)
    return [phys[int(m.group(1))]] if m and int(m.group(1)) < len(phys) else []


def busy_processes(
    report: GpuReport, indices: list[int], limit_bytes: int, own_pid: int
) -> list[GpuProcess]:
    busy = []
    for g in report.gpus:
        if g.index in indices:
            busy += [p for p in g.processes if p.pid != own_pid and p.used_bytes > limit_bytes]
    return busy


def gpu_preflight(
    device: str, max_foreign: int, ignore: bool, log, count: int | None = None
) -> None:
    """Refuse to start when a foreign process holds more than `max_foreign` bytes on our GPUs."""
    import os

    if device == "cpu":
        return
    report = query_gpus()
    if not report.gpus:
        log(f"GPU preflight: {report.note}")
        return
    busy = busy_processes(
        report, gpus_for_device(device, len(report.gpus), count), max_foreign, os.getpid()
    )
    if not busy:
        return
    lines = [
        f"  GPU {p.gpu_index}: PID {p.pid} holds {p.used_bytes / (1 << 30):.1f} GiB: {p.cmdline or p.name} [{p.owner()}]"
        + f"\n    {stop_advice(p)}"
        for p in busy
    ]
    msg = "other processes hold memory on the GPUs this run needs:\n" + "\n".join(lines)
    if ignore:
        log("warning (--ignore-busy-gpus): " + msg)
        return
    raise GpuBusy(msg + "\n  (or pass --ignore-busy-gpus to start anyway)")
