"""Network: the Transport interface, the hivemind node and DHT host, the direct TCP data plane and its hello."""
