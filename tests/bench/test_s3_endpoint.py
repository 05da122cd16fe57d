"""The S3 server the tests and the benchmark start (:mod:`fastdcp.bench.s3_endpoint`)."""

from __future__ import annotations

import json
import urllib.request

import pytest

from fastdcp.bench.s3_endpoint import VOLUME_SLOTS


def test_seaweedfs_has_volume_room_for_every_bucket_of_a_whole_run(s3_endpoint):
    """SeaweedFS gives every bucket volumes of its own; capped by its default (free disk divided by
    the volume size: a few dozen on a small disk), the PUTs of a later bucket fail with 500
    InternalError. The server is started with a cap far above the buckets a whole test run makes."""
    if s3_endpoint.server_name != "seaweedfs":
        pytest.skip("FASTDCP_S3_SERVER=moto: moto keeps objects in memory, no volumes to count")
    with urllib.request.urlopen(f"http://127.0.0.1:{s3_endpoint.master_port}/dir/status", timeout=30) as answer:
        topology = json.load(answer)["Topology"]
    assert topology["Max"] >= VOLUME_SLOTS
    buckets = len(s3_endpoint._client().list_buckets().get("Buckets", []))
    assert topology["Free"] >= VOLUME_SLOTS - 4 * buckets
