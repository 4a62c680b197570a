"""The test bed, a library for tests/ and bench/: real hubs and nodes (forked or in process), peers,
network namespaces, model variants, and the fault and relay scenarios both run."""
