"""The on-disk form, pure (no file I/O): ``torch.save`` tensor blobs (laid out and parsed),
``.metadata`` (parsed without trusting it, validated; emitted from a chunk table), the chunk index
beside it, and the checksums recorded in them. Readers take bytes, or a ``PositionalSource``
(:mod:`fastdcp.format.sources`) that ``io/`` implements for files."""
