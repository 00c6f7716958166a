"""Bottom layer: the wire schema and framing, DHT record layout, tensor codecs (and their names, torch-free),
state hashing, outcomes, short ids and bounded reasons, the hook interface a test harness steps in through."""
