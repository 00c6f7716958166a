"""Bottom layer: the wire schema and framing, DHT record layout, tensor codecs, state hashing, outcomes, hooks."""
