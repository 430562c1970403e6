"""The per-host KV transfer agent: maps local workers' KV pools (POSIX shared memory) and moves
pages between agents over UCX (default) or TCP, with strict ticket and layout checks.

Modules, bottom up: `runs` (page-run arithmetic), `errors`, `pool` (layouts and mapped pools),
`tickets` (expected writes, leases, cancellation), `wire` (the data-path header and replies),
`transport` (the contract) with `ucx` and `tcp`, `peers` (remote agents' info over gRPC),
`agent` (the state and the send path), `servicer`, `config`, `main`, `bench`.
"""
