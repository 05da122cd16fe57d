"""What fastdcp relies on in torch beyond its public API, in one place (:mod:`.torch_internals`)."""
