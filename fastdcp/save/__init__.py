"""The save path: :class:`~fastdcp.save.writer.FastFileSystemWriter`, the file images it plans,
GPU tensor bytes through a pinned ring, ``dcp.async_save`` staging, and the atomic commit."""
