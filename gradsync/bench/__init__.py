"""``gradsync bench``: throughput, overhead, bytes and a correctness check for every strategy."""
