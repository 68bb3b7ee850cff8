"""Real local servers for tests, benchmarks and the demo: redis-server on a free
loopback port and moto's threaded S3 server."""
