"""`maester launch JOB --nproc N`: run a job directory on this machine under torchrun, with the log layout of a
SLURM job (`logs/<id>.out|.err` and `logs/latest.*`), so local and cluster runs read the same way."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from maester.files import point_link
from maester.jobs.job_dir import is_job_dir, refuse_checkpoint


def _tee(source, sinks) -> None:
    for line in iter(source.readline, b""):
        for sink in sinks:
            sink.write(line)
            sink.flush()
    source.close()




def launch_local(job_dir: Path, nproc: int = 1) -> int:
    """Train the job in `nproc` local processes; returns torchrun's exit status. Output goes to the console and
    to `logs/local-<time>.out|.err`."""
    refuse_checkpoint(job_dir, "launch")
    if not is_job_dir(job_dir):
        raise FileNotFoundError(f"{job_dir} is not a job directory (no config.json): create one with "
                                f"`maester submit CONFIG --no-submit`")
    if nproc < 1:
        raise ValueError(f"--nproc {nproc}: must be at least 1")
    logs = job_dir / "logs"
    logs.mkdir(exist_ok=True)
    name = time.strftime("local-%Y%m%d-%H%M%S")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "-m", "maester", "train", str(job_dir)]
    with open(logs / f"{name}.out", "ab") as out, open(logs / f"{name}.err", "ab") as err:
        for suffix in ("out", "err"):
            point_link(logs / f"latest.{suffix}", f"{name}.{suffix}")
        err.write(f"[{time.strftime('%F %T')}] {' '.join(cmd)}\n".encode())
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        # Ctrl-C or a TERM to this process reaches torchrun, which stops its workers.
        forward = lambda signum, frame: proc.send_signal(signum)  # noqa: E731
        previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
        threads = [threading.Thread(target=_tee, args=(proc.stdout, [sys.stdout.buffer, out])),
                   threading.Thread(target=_tee, args=(proc.stderr, [sys.stderr.buffer, err]))]
        try:
            for t in threads:
                t.start()
            status = proc.wait()
            for t in threads:
                t.join()
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
        err.write(f"[{time.strftime('%F %T')}] exited with status {status}\n".encode())
    return status
