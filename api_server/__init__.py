"""The HTTP API: validates, authenticates, queues requests per model and waits for the worker's reply."""
