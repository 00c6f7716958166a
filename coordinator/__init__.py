"""swarmloco coordinator: records runs, peers, rounds and metrics; serves the API, dashboard and /metrics."""
