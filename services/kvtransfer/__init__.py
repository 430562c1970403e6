"""The per-host KV transfer agent: maps local workers' KV pools (POSIX shared memory) and moves
pages between agents over UCX (default) or TCP, with strict ticket and layout checks.

Modules, bottom up (below them pdserve.common.kv: `runs`, `errors`, `wire`, the sending half
of the same-host copy, shared with the prefill worker's same-host lane): `pool` (layouts and
mapped pools), `tickets` (expected writes, leases, cancellation), `transport` (the contract)
with `ucx` and `tcp`, `shm` (the same-host copy), `peers` (remote agents' info over gRPC),
`agent` (the state and the send path), `servicer`, `config`, `main`, `bench`.
"""
