"""Test harness for the protocol: an in-memory transport and a fault injector. Production modules never import it."""
