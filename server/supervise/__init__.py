"""`batchfit up`: replicas and Nginx as processes, not requests."""
