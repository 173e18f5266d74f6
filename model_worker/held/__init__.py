"""The messages a worker holds: the pool of requests not yet started, the leases that keep every held
message from being redelivered, and the log context bound to each."""
