"""Prometheus output: a collector over the agent's immutable state, the metric catalogue, and the
HTTP server / Pushgateway / textfile writers. prometheus_client is imported only where used."""
