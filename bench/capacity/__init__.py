"""Capacity by simulation: a day of traffic through the worker's scheduling rules and the deployed autoscaler."""
