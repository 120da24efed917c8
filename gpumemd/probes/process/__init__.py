"""This process and its neighbours: RSS and memory limits, worker processes and DataLoaders, rank, environment."""
