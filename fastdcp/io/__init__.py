"""The machine side: the native engine and its options, page-aligned (shared, pinned) host
memory, a checkpoint's files on disk, and pausing the garbage collector around bulk work."""
