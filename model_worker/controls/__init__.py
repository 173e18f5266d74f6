"""Control models (ControlNets, IP-Adapters) on the worker: loaded off the device thread into a byte-sized cache."""
