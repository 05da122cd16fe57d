"""The on-disk form, pure (no file I/O): ``torch.save`` tensor blobs (laid out and parsed),
``.metadata`` (parsed without trusting it, validated), and the checksums recorded in it."""
