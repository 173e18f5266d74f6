"""The worker's serving loop: intake (pull when there is room), the device loop and the step scheduler,
the finisher (encode, store, publish, ack), the watchdog, the probes and metrics, and the wiring of one process."""
