"""Benchmark of the bundle as a DICOM node: the seconds from a chest CT's last instance arriving by C-STORE to its
RTSTRUCT arriving at the destination, for one study, then for three studies sent at once.

dcmtk's ``storescu`` sends each study (the synthetic chest: a planning CT of 512 x 512 pixels, neck to upper abdomen,
with its SEG, as a TCIA download holds it) to ``monai.bundle run serve``; dcmtk's ``storescp`` is the planning system
and notes when each object arrives. The latency counts the quiet period (``--quiet_s``, the node's default unless
given), the inference (a child ``monai.bundle run inference``: its start, the CPU runtime, the writers) and the send;
each is printed. The weights are given (their network decides the time per window: name it beside the numbers)::

    python -m benchmarks.bench_node --weights runs/demo/model.pt [--config demo] [--quiet_s 10] [--output_dir DIR]
"""

from __future__ import annotations

import json
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SLICES = (110, 120, 130)  # chest CTs of 3 mm slices
DCMTK = "/usr/local/bin:/usr/bin:/bin"  # not the Python tools of the same names pynetdicom installs


def main(weights: str, config: str = "demo", quiet_s: float = 10.0, output_dir: str | None = None) -> dict[str, Any]:
    """Write the studies, start the destination and the node, send one study, then three at once; print a row each."""
    from scripts.data.synthetic import write_chest_case

    storescu, storescp = shutil.which("storescu", path=DCMTK), shutil.which("storescp", path=DCMTK)
    if not (storescu and storescp):
        raise SystemExit("needs dcmtk's storescu and storescp (apt-get install dcmtk)")
    folder = Path(output_dir) if output_dir else Path(tempfile.mkdtemp(prefix="bench_node_"))
    studies = [folder / "in" / f"CHEST-{k}" for k in range(4)]
    for k, study in enumerate(studies):
        if not study.exists():
            write_chest_case(study, f"CHEST-{k}", (512, 512, SLICES[k % len(SLICES)]), seed=k)
    tps_port, node_port = _free_port(), _free_port()
    arrivals = folder / "arrivals.txt"
    for earlier in (folder / "node", folder / "tps"):  # a node's queue and a destination from scratch (studies kept)
        shutil.rmtree(earlier, ignore_errors=True)
    arrivals.unlink(missing_ok=True)
    (folder / "tps").mkdir(parents=True)
    tps = subprocess.Popen([storescp, "-aet", "TPS", "-od", str(folder / "tps"), "-xcr",
                            f"echo #f $(date +%s.%N) >> {arrivals}", str(tps_port)])  # fmt: skip
    configs = ["configs/inference.yaml"] + ([f"configs/{config}.yaml"] if config else [])
    node_log = (folder / "node.log").open("w")
    node = subprocess.Popen([sys.executable, "-m", "monai.bundle", "run", "serve", "--config_file", str(configs),
                             "--output_dir", str(folder / "node"), "--dicom_port", str(node_port), "--dicom_bind",
                             "127.0.0.1", "--dicom_destinations", str([f"TPS@127.0.0.1:{tps_port}"]),
                             "--dicom_quiet_s", str(quiet_s), "--model_path", weights], cwd=ROOT, stdout=node_log,
                            stderr=subprocess.STDOUT)  # fmt: skip
    try:
        _wait(lambda: "listening on" in (folder / "node.log").read_text(), 300, "the node to listen")
        send = [storescu, "-R", "-aet", "BENCH", "-aec", "NSCLC_GTV", "+sd", "+r", "127.0.0.1", str(node_port)]
        rows = [_send(send, studies[:1], arrivals, folder), _send(send, studies[1:], arrivals, folder)]
        print(f"chest CTs of 512 x 512 x {min(SLICES)}-{max(SLICES)} (with their SEG), weights {weights}, quiet period "
              f"{quiet_s:g} s\n")  # fmt: skip
        print("| studies sent at once | last instance to RTSTRUCT, s (each) | inference s (each) | all served |")
        print("|---|---|---|---|")
        for row in rows:
            print(f"| {len(row['latency_s'])} | {', '.join(f'{s:.1f}' for s in row['latency_s'])} | "
                  f"{', '.join(f'{s:.1f}' for s in row['inference_s'])} | {row['served']} |")  # fmt: skip
        return {"rows": rows, "quiet_s": quiet_s}
    finally:
        for process in (node, tps):
            process.send_signal(signal.SIGTERM)
            process.wait(60)
        node_log.close()
        if not output_dir:
            shutil.rmtree(folder, ignore_errors=True)


def _send(command: list[str], studies: list[Path], arrivals: Path, folder: Path) -> dict[str, Any]:
    """Send ``studies`` at once (a storescu each); per study the seconds from its storescu's end (its last instance
    acknowledged) to its RTSTRUCT's arrival, and the seconds its inference took."""
    import pydicom

    uids = [pydicom.dcmread(next(p for p in study.rglob("*") if p.is_file()), stop_before_pixels=True).StudyInstanceUID
            for study in studies]  # fmt: skip
    senders = [subprocess.Popen([*command, str(study)], stdout=subprocess.DEVNULL) for study in studies]
    sent = {}
    while len(sent) < len(senders):
        for uid, sender in zip(uids, senders, strict=True):
            if uid not in sent and sender.poll() is not None:
                if sender.returncode:
                    raise RuntimeError(f"storescu of study {uid} failed with status {sender.returncode}")
                sent[uid] = time.time()
        time.sleep(0.05)
    arrived = _wait(lambda: _rtstructs(arrivals, folder, uids), 1800, "every RTSTRUCT at the destination")
    inferred = [json.loads((folder / "node" / "studies" / uid / "v1" / "inferred.json").read_text()) for uid in uids]
    return {"latency_s": [arrived[uid] - sent[uid] for uid in uids], "served": sum(uid in arrived for uid in uids),
            "inference_s": [outcome["seconds"] for outcome in inferred]}  # fmt: skip


def _rtstructs(arrivals: Path, folder: Path, uids: list[str]) -> dict[str, float] | None:
    """When each study's RTSTRUCT arrived (storescp names an RTSTRUCT file RS.<uid>), once all have."""
    import pydicom

    found = {}
    for line in arrivals.read_text().splitlines() if arrivals.exists() else []:
        name, when = line.rsplit(" ", 1)
        if Path(name).name.startswith("RS."):
            path = next((folder / "tps").rglob(Path(name).name))
            found[pydicom.dcmread(path, stop_before_pixels=True).StudyInstanceUID] = float(when)
    return found if all(uid in found for uid in uids) else None


def _wait(condition, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = condition()
        if found:
            return found
        time.sleep(0.1)
    raise TimeoutError(f"waited {timeout:.0f} s for {what}")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


if __name__ == "__main__":
    import fire
    from scripts.common.cli import printed

    fire.Fire(printed(main))
