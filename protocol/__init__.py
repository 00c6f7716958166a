"""The swarm protocol, in layers; a module imports only from its own layer and the layers below it:

base     the wire schema (.proto) and its framing, DHT record layout, tensor codecs and their names, state
         hashing, outcomes, short ids and bounded reasons (text.py), the test harness's hook interface
trust    identities and signatures, admission tickets, signed records and reports, signed payloads, certificates
network  the Transport interface and its hivemind implementation, DHT hosting, the direct TCP data plane
chain    this peer's certified head, fork choice, serving and pulling verified state
round    the round: its rules and config, matchmaking, the claims and plan, the sharded robust reduce, the audit,
         certification, and the Averager that runs it all
testing  an in-memory transport and a fault injector, for tests only

It knows nothing about models, data or HTTP. tests/unit/test_layering.py enforces the order.
"""
