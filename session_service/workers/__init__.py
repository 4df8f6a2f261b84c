"""The workers: finding them, placing sessions on them, one link per worker, and routing
their step outputs back to sessions.

``link`` (one Run stream per worker) with ``write_pacing`` (when it writes: by the worker's
tick), ``placement`` (rendezvous placement over worker ids), ``discovery`` (a static list or a
DNS name), ``eviction`` (a moved session dropped at its old worker), ``liveness`` (what a worker
owes, for stall detection), ``step_routing`` (step outputs to runners), ``sparse_check`` (the
fail-closed check of every step's sparse audio).
"""
