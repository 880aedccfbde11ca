"""Client cost of moving checkpoint bytes to and from S3: boto3 versus megashard's bulk path.

Starts the moto test endpoint (tests/scripts/s3_server.py) on 127.0.0.1 and, in interleaved repeats,
downloads and uploads one object of ``--mib`` MiB with

  * boto3 ``get_object()["Body"].read()`` and ``download_fileobj`` (s3transfer), ``upload_fileobj`` (s3transfer,
    default TransferConfig and checksum settings: what a user of boto3 gets);
  * megashard ``ObjectStore.read_into`` (presigned ranged GETs, ``readinto`` into one buffer) and
    ``ObjectStore.upload`` (one PUT or multipart parts sent straight from a memoryview).

Reports medians of the client's CPU seconds per GiB (``time.process_time``, all threads of this process;
the endpoint runs in another process) and GB/s. The endpoint is moto (Python), so GB/s is bounded by it
and says little about real S3; CPU per GiB is the client's own cost and is what the comparison is about.

    python scripts/bench_s3_client.py [--mib 128] [--repeats 3]
"""
from __future__ import annotations

import argparse
import io
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Tuple

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from s3_endpoint import S3Server  # noqa: E402

GiB = 1 << 30


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=128, help="object size in MiB (default 128)")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved repeats (default 3)")
    args = parser.parse_args()
    size = args.mib << 20

    with_tmp = Path(os.environ.get("TMPDIR", "/tmp")) / f"bench_s3_{os.getpid()}.jsonl"
    server = S3Server(with_tmp)
    try:
        os.environ.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing",
                          AWS_DEFAULT_REGION="us-east-1", AWS_ENDPOINT_URL=server.endpoint,
                          AWS_CONFIG_FILE=os.devnull, AWS_SHARED_CREDENTIALS_FILE=os.devnull)
        import boto3

        from megashard.storage.s3 import ObjectStore

        bucket = "bench-s3-client"
        server.request("PUT", f"/{bucket}")
        raw = boto3.client("s3", endpoint_url=server.endpoint, region_name="us-east-1")
        store = ObjectStore(bucket)
        data = os.urandom(size)
        raw.put_object(Bucket=bucket, Key="src", Body=data)
        info = store.head("src")
        out = bytearray(size)

        def boto3_get() -> None:
            assert len(raw.get_object(Bucket=bucket, Key="src")["Body"].read()) == size

        def boto3_download_fileobj() -> None:
            buf = io.BytesIO()
            raw.download_fileobj(bucket, "src", buf)
            assert buf.tell() == size

        def ours_read_into() -> None:
            store.read_into("src", [(0, memoryview(out))], size=size, etag=info.etag)

        def ours_read_into_one_get() -> None:  # moto copies the whole object per ranged GET: one GET shows its cost
            os.environ["MEGASHARD_S3_GET_BYTES"] = str(size)
            try:
                store.read_into("src", [(0, memoryview(out))], size=size, etag=info.etag)
            finally:
                del os.environ["MEGASHARD_S3_GET_BYTES"]

        def boto3_upload_fileobj() -> None:
            raw.upload_fileobj(io.BytesIO(data), bucket, "dst-boto3")

        def ours_upload() -> None:
            store.upload("dst-ours", size, [(0, memoryview(data))], if_none_match=False)

        cases: List[Tuple[str, str, Callable[[], None]]] = [
            ("download", "boto3 get_object().read()", boto3_get),
            ("download", "boto3 download_fileobj", boto3_download_fileobj),
            ("download", "megashard read_into", ours_read_into),
            ("download", "megashard read_into, 1 GET", ours_read_into_one_get),
            ("upload", "boto3 upload_fileobj", boto3_upload_fileobj),
            ("upload", "megashard upload", ours_upload),
        ]
        samples: Dict[str, List[Tuple[float, float]]] = {name: [] for _, name, _ in cases}
        for _, _, fn in cases:  # warm up: connections, imports, first presign
            fn()
        for _ in range(args.repeats):
            for _, name, fn in cases:
                cpu0, wall0 = time.process_time(), time.perf_counter()
                fn()
                cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
                samples[name].append((cpu, wall))
        assert bytes(out) == data
        assert raw.get_object(Bucket=bucket, Key="dst-ours")["Body"].read() == data

        print(f"object {args.mib} MiB, {args.repeats} interleaved repeats, medians; endpoint: moto on 127.0.0.1, "
              f"boto3 {boto3.__version__}, {os.cpu_count()} CPUs")
        print(f"{'direction':<9} {'client':<28} {'CPU s/GiB':>10} {'GB/s':>7}")
        for direction, name, _ in cases:
            cpu = statistics.median(c for c, _ in samples[name]) * GiB / size
            gbs = size / statistics.median(w for _, w in samples[name]) / 1e9
            print(f"{direction:<9} {name:<28} {cpu:>10.3f} {gbs:>7.2f}")
        print(f"megashard requests: {dict(sorted(store.stats.items()))}")
    finally:
        server.stop()
        with_tmp.unlink(missing_ok=True)


if __name__ == "__main__":
    main()
