"""Simulated workers: the pdserve.v1 worker protocols with profiled times, many per process."""
