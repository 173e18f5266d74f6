"""What every room of the API uses: the one error shape, API-key auth, the process's Prometheus metrics, and
Redis as a dependency the API can lose."""
