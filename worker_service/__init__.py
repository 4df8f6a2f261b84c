"""The worker tier: a batched torch engine behind ``duplex.v1.DuplexWorker``."""
