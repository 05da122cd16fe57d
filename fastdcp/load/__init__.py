"""The load path: :class:`~fastdcp.load.reader.FastFileSystemReader`, its header pass, the pieces
of stored tensors a load reads, their CPU and GPU placement, and checksum verification."""
