"""Downloading a weights folder from S3 (a SeaweedFS server on loopback): `download_dir`'s
parallel ranged GETs against one stream per file, one file after another.

Candidates, interleaved, each downloading the same folder (2 files of 64 MiB of random
bytes, or 2 x 20 MiB with `--quick`) into a fresh local folder:

- one_stream: `transfer._copy_files`, the S3 path `download_dir` had before: each file read
  through pyarrow's input stream in one GET and hashed as it is read, one file after
  another;
- parallel: `transfer.download_dir`, each file in ranged GETs of DOWNLOAD_PART_BYTES,
  DOWNLOAD_STREAMS in flight over the folder, DOWNLOAD_FILES files at once, hashed as they
  are written (plus its listing, temp folder and rename);
- bare: boto3's transfer manager downloading the same files to file names with the same
  part size and streams, both files at once: the floor of moving those bytes in ranged
  GETs (no hashing, no in-order writes, no retries).

Each runs twice: `loopback`, straight to the server, and `capped`, through a proxy on
loopback that lets each connection's responses through at CAP_MB_S (a store across a
network, where one connection is bound by its round trips and window, not by the CPU). On
loopback the server shares the machine's cores with the client, so there parallel streams
mostly compete for CPU; `capped` is the case `download_dir` is for.

Ratios: one_stream's time over parallel's (the speed-up), and parallel's over bare's (what
in-order hashing and the guarantees cost).
"""

from __future__ import annotations

import os
import shutil
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import interleaved, median, paired_ratio, parse_args, report  # noqa: E402

# What one connection of the `capped` endpoint carries, MB/s: tens of MB/s is what a
# single S3 GET stream gets across a network.
CAP_MB_S = 50.0


class CappedProxy:
    """A TCP proxy on a free loopback port to `port`: every accepted connection gets its own
    upstream connection, and what comes back on it is paced to `rate` bytes/s (no credit
    for idle time, so a keep-alive connection cannot burst). Threads; stopped with the
    process (daemon threads), its listening socket closed by `close`."""

    def __init__(self, port: int, rate: float) -> None:
        self._port, self._rate = port, rate
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(128)
        self.endpoint = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def close(self) -> None:
        self._sock.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._sock.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self._port))
            for src, dst, rate in ((client, upstream, None), (upstream, client, self._rate)):
                threading.Thread(target=self._pump, args=(src, dst, rate), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket, rate: float | None) -> None:
        due = time.monotonic()
        try:
            while data := src.recv(64 << 10):
                if rate:
                    due = max(due, time.monotonic()) + len(data) / rate
                    time.sleep(max(0.0, due - time.monotonic()))
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                s.close()


def main() -> None:
    from boto3.s3.transfer import TransferConfig, create_transfer_manager

    from bench._s3 import s3_server
    from replayrl.storage import objects, s3, transfer

    args = parse_args(__doc__.splitlines()[0])
    repeats = args.repeats or (2 if args.quick else 5)
    file_bytes = (20 if args.quick else 64) << 20
    names = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    with s3_server() as server, tempfile.TemporaryDirectory(prefix="bench-download-") as tmp:
        os.environ.update(server.env())
        uri = f"s3://{server.bucket}/bench-download/v1"
        src = Path(tmp) / "src"
        src.mkdir()
        for name in names:
            with open(src / name, "wb") as f:
                for _ in range(file_bytes >> 20):
                    f.write(os.urandom(1 << 20))
        uploaded = transfer.upload_dir(src, uri)
        shutil.rmtree(src)
        proxy = CappedProxy(server.ports["s3.port"], CAP_MB_S * 1e6)
        endpoints = {"loopback": server.endpoint, "capped": proxy.endpoint}
        counter = iter(range(1, 1_000_000))
        config = TransferConfig(
            multipart_threshold=transfer.DOWNLOAD_PART_BYTES,
            multipart_chunksize=transfer.DOWNLOAD_PART_BYTES,
            max_concurrency=transfer.DOWNLOAD_STREAMS,
        )

        def fresh(endpoint: str) -> Path:
            os.environ["AWS_ENDPOINT_URL"] = endpoint  # read at each call of `objects`
            return Path(tmp) / f"d{next(counter)}"

        def one_stream(endpoint: str) -> None:
            dest = fresh(endpoint)
            dest.mkdir()
            fs, path = objects.filesystem(uri)
            files = transfer._listed_files(fs, uri, path, objects._skip_nothing)
            got = transfer._copy_files(fs, uri, files, dest)
            assert got == uploaded, "one_stream: digests differ from the upload"
            shutil.rmtree(dest)

        def parallel(endpoint: str) -> None:
            dest = fresh(endpoint)
            got: dict = {}
            transfer.download_dir(uri, dest, check=got.update)
            assert got == uploaded, "parallel: digests differ from the upload"
            shutil.rmtree(dest)

        def bare(endpoint: str) -> None:
            dest = fresh(endpoint)
            dest.mkdir()
            client = s3.client(objects.s3_settings())
            with create_transfer_manager(client, config) as manager:
                futures = [
                    manager.download(*s3.split(f"{uri}/{name}"), str(dest / name)) for name in names
                ]
                for future in futures:
                    future.result()
            shutil.rmtree(dest)

        times = {}
        for where, endpoint in endpoints.items():
            times[where] = interleaved(
                {
                    "one_stream": lambda e=endpoint: one_stream(e),
                    "parallel": lambda e=endpoint: parallel(e),
                    "bare": lambda e=endpoint: bare(e),
                },
                repeats=repeats,
            )
        proxy.close()
    total = file_bytes * len(names)
    figures: dict[str, object] = {
        "files": len(names),
        "file_bytes": file_bytes,
        "part_bytes": transfer.DOWNLOAD_PART_BYTES,
        "streams": transfer.DOWNLOAD_STREAMS,
        "files_at_once": transfer.DOWNLOAD_FILES,
        "capped_mb_per_s_per_connection": CAP_MB_S,
        "repeats": repeats,
    }
    ratios = {}
    for where, t in times.items():
        for name, values in t.items():
            figures[f"{where}_{name}_s"] = median(values)
            figures[f"{where}_{name}_mb_per_s"] = total / median(values) / 1e6
        ratios[f"{where}_parallel_speedup_over_one_stream"] = paired_ratio(
            t["one_stream"], t["parallel"]
        )
        ratios[f"{where}_parallel_over_bare"] = paired_ratio(t["parallel"], t["bare"])
    targets = {
        "capped_parallel_speedup_over_one_stream": ">= 3",
        # The bare floor writes parts where they land; `download_dir` writes (and hashes)
        # each file in order, so the parts that came early are written at the end: with
        # only 4 parts a file here that tail is a large share of the time.
        "capped_parallel_over_bare": "<= 2.0",
        "loopback_parallel_speedup_over_one_stream": ">= 0.8",
    }
    report("download", args=args, figures=figures, ratios=ratios, targets=targets)


if __name__ == "__main__":
    main()
