"""Trust: identities and signatures, admission tickets, signed DHT records and reports, signed payloads,
certificates."""
