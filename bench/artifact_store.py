"""What the artifact store costs a trial: upload and download seconds of its state and best model,
and the training time lost to checkpointing with no checkpoints, local checkpoints only, local
plus the background upload (what hpo does), and local plus a blocking upload.

    .venv/bin/python bench/artifact_store.py                      # demo, file:// and s3:// (moto)
    .venv/bin/python bench/artifact_store.py --stores s3 --repeats 3

The s3 store is moto's server in a process of its own on 127.0.0.1 (so its work does not share
this process's interpreter lock with training), with a checkpoint at every evaluation
(checkpoint_interval 0): the worst case for what checkpoints cost.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from hpo.config.loader import load_config  # noqa: E402
from hpo.config.search_paths import with_params  # noqa: E402
from hpo.storage.artifacts import ArtifactStore, ArtifactTarget  # noqa: E402
from hpo.trainer.checkpoint import CheckpointStore  # noqa: E402
from hpo.trainer.config import TrainJob  # noqa: E402
from hpo.trainer.data import PreparedData  # noqa: E402
from hpo.trainer.loop import train  # noqa: E402
from hpo.trainer.model import load_tokenizer  # noqa: E402
from hpo.trainer.tasks import prepare_data  # noqa: E402
from hpo.trial.uploads import BackgroundUploader  # noqa: E402

MODES = ("none", "local", "background", "blocking")
STUDY, FOLDER = "bench-000000000000", "trial-0"


@dataclass
class Run:
    mode: str
    store: str
    wall_s: float  # train() from start to return: what the trial waits for
    checkpoint_s: float  # local writes
    upload_s: float  # seconds the uploads took (in the background or not)
    tail_s: float  # waited after training for the last uploads (background only)
    evaluations: int


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=REPO / "configs" / "demo.yaml")
    parser.add_argument("--stores", nargs="+", default=["file", "s3"], choices=["file", "s3"])
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--epochs", type=int, default=None, help="override training.epochs")
    parser.add_argument("--device", default=None, help="override training.device")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument(
        "--hidden-size",
        type=int,
        default=None,
        help="an inline model's hidden size (intermediate 4x): bigger checkpoints",
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    if args.threads is not None:  # on a shared CPU, spinning threads stall (see README)
        import torch

        torch.set_num_threads(args.threads)
    config = load_config(args.config)
    if args.epochs is not None:
        config.training.epochs = args.epochs
    if args.device is not None:
        config.training.device = args.device
    if args.hidden_size is not None and config.model.config:
        config.model.config["hidden_size"] = args.hidden_size
        config.model.config["intermediate_size"] = 4 * args.hidden_size
    data = prepare_data(
        config.data, load_tokenizer(config.model, config.task), config.task, config.training
    )
    job = with_params(config, {}, bound_batch_search=False)
    runs: list[Run] = []
    transfers: list[str] = []
    with tempfile.TemporaryDirectory() as scratch:
        for store_kind in args.stores:
            with _store(store_kind, Path(scratch)) as url:
                if store_kind == args.stores[0]:  # untimed: kernels and caches warm up
                    _train_once(job, data, "none", url, store_kind, Path(scratch))
                for _ in range(args.repeats):
                    for mode in MODES:
                        if mode in ("none", "local") and store_kind != args.stores[0]:
                            continue  # the same run whatever the store
                        runs.append(_train_once(job, data, mode, url, store_kind, Path(scratch)))
                transfers += _transfers(url, store_kind, Path(scratch))
    print(_table(runs))
    print()
    print("\n".join(transfers))
    return 0


def _train_once(
    job: TrainJob, data: PreparedData, mode: str, url: str, store_kind: str, scratch: Path
) -> Run:
    folder = Path(tempfile.mkdtemp(dir=scratch)) / FOLDER
    checkpoints = None if mode == "none" else CheckpointStore(folder, interval_s=0.0)
    artifacts = ArtifactStore(url)
    uploader = None
    blocking_s = [0.0]
    if checkpoints is not None and mode == "background":
        uploader = BackgroundUploader(artifacts, ArtifactTarget(url, STUDY, FOLDER))
        checkpoints.on_saved = uploader.submit
    if checkpoints is not None and mode == "blocking":
        checkpoints.on_saved = _blocking(artifacts, blocking_s)
    started = time.perf_counter()
    result = train(
        replace(job, training=replace(job.training)), data, None, "accuracy", checkpoints
    )
    wall_s = time.perf_counter() - started
    tail_s, upload_s = 0.0, blocking_s[0]
    if uploader is not None:
        waited = time.perf_counter()
        uploader.close(timeout_s=600)
        tail_s, upload_s = time.perf_counter() - waited, uploader.stats.upload_s
    # The last run's folder stays for the transfer timings.
    return Run(
        mode,
        store_kind if mode not in ("none", "local") else "-",
        wall_s,
        checkpoints.seconds if checkpoints else 0.0,
        upload_s,
        tail_s,
        len(result.evaluations),
    )


def _blocking(artifacts: ArtifactStore, spent: list[float]) -> Callable[[str, Path], None]:
    def upload(kind: str, path: Path) -> None:
        started = time.perf_counter()
        artifacts.publish(STUDY, FOLDER, kind, path)
        spent[0] += time.perf_counter() - started

    return upload


def _transfers(url: str, store_kind: str, scratch: Path) -> list[str]:
    """Seconds to publish and fetch the newest state and best model a run left in scratch."""
    states = sorted(scratch.glob(f"*/{FOLDER}/checkpoint.pt"), key=lambda p: p.stat().st_mtime)
    if not states:
        return [f"{store_kind}: no state left to time"]
    folder = states[-1].parent
    artifacts = ArtifactStore(url)
    lines = []
    for kind, source in (
        ("state", folder / "checkpoint.pt"),
        ("best-model", folder / "best-model"),
    ):
        started = time.perf_counter()
        manifest = artifacts.publish(STUDY, "trial-9", kind, source)
        up_s = time.perf_counter() - started
        started = time.perf_counter()
        artifacts.fetch(STUDY, "trial-9", kind, Path(tempfile.mkdtemp(dir=scratch)) / "x")
        down_s = time.perf_counter() - started
        lines.append(
            f"{store_kind} {kind}: {manifest.size / 1e6:.1f} MB, upload {up_s:.3f} s, "
            f"download (sha256 checked) {down_s:.3f} s"
        )
    return lines


def _table(runs: list[Run]) -> str:
    lines = [
        "| checkpoints | store | train wall s (median) | local write s | upload s | "
        "wait after training s | evaluations | runs |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    keys = list(dict.fromkeys((r.mode, r.store) for r in runs))
    for mode, store in keys:
        same = [r for r in runs if (r.mode, r.store) == (mode, store)]
        med = {
            name: statistics.median(getattr(r, name) for r in same)
            for name in ("wall_s", "checkpoint_s", "upload_s", "tail_s")
        }
        lines.append(
            f"| {mode} | {store} | {med['wall_s']:.2f} | {med['checkpoint_s']:.2f} | "
            f"{med['upload_s']:.2f} | {med['tail_s']:.2f} | {same[0].evaluations} | "
            f"{len(same)} |"
        )
    return "\n".join(lines)


@contextmanager
def _store(kind: str, scratch: Path) -> Iterator[str]:
    if kind == "file":
        (scratch / "shared").mkdir(exist_ok=True)
        yield f"file://{scratch / 'shared'}"
        return
    with _moto_server() as endpoint:
        os.environ.update(
            {
                "AWS_ENDPOINT_URL": endpoint,
                "AWS_ACCESS_KEY_ID": "bench",
                "AWS_SECRET_ACCESS_KEY": "bench",
                "AWS_DEFAULT_REGION": "us-east-1",
            }
        )
        import boto3

        boto3.client("s3").create_bucket(Bucket="bench")
        yield "s3://bench/hpo"


@contextmanager
def _moto_server() -> Iterator[str]:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.2)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.terminate()
        server.wait(10)


if __name__ == "__main__":
    raise SystemExit(main())
