"""Checkpoints in object storage (``s3://bucket/prefix``): the same checkpoint format as on a
file system, written as objects by concurrent multipart uploads and read by concurrent ranged GETs.

The writer and reader reuse the local stages' products: ``save/`` plans each data file as an
image of segments (:mod:`fastdcp.save.file_image`), ``load/`` turns a load plan into byte runs
(:mod:`fastdcp.load.pieces`); only where the bytes go differs (:mod:`.transfer`)."""
