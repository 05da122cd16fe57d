"""The benchmark's S3 proxy with a bandwidth limit (``S3Endpoint(rate_mib_s=...)``): every
connection shares one rate, so two concurrent downloads take as long as one of twice the size, and
the proxy counts the bytes it served (what the ``read_once`` scenario reports as storage reads)."""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor

from fastdcp.bench.s3_endpoint import S3Endpoint

RATE = 40  # MiB/s


def test_the_rate_is_shared_by_every_connection(tmp_path):
    with S3Endpoint(workdir=tmp_path, rate_mib_s=RATE) as endpoint:
        import boto3

        env = endpoint.env()
        s3 = boto3.client("s3", endpoint_url=endpoint.endpoint, region_name=env["AWS_REGION"],
                          aws_access_key_id=env["AWS_ACCESS_KEY_ID"], aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"])
        s3.create_bucket(Bucket="rated")
        body = os.urandom(8 << 20)
        s3.put_object(Bucket="rated", Key="a", Body=body)
        s3.put_object(Bucket="rated", Key="b", Body=body)
        endpoint.reset()
        started = time.monotonic()
        with ThreadPoolExecutor(2) as pool:
            got = list(pool.map(lambda k: s3.get_object(Bucket="rated", Key=k)["Body"].read(), ["a", "b"]))
        seconds = time.monotonic() - started
        assert got == [body, body]
        served = endpoint.traffic()["down"]
        assert 16 << 20 <= served < (16 << 20) + (64 << 10)
        # 16 MiB at 40 MiB/s: 0.4 s at least; unthrottled loopback takes a small fraction of that.
        assert seconds >= 0.95 * served / (RATE << 20), seconds
