"""The KV handoff's protocol, shared by the kvtransfer agent and the prefill worker's same-host
lane: `errors` (its failures, their gRPC codes and wire names), `runs` (page-run arithmetic),
`wire` (the write header and replies, the layout check), `samehost` (the sending half of the
same-host copy's `shm_write`), `spans` (the kv.send span). No I/O at import, no service
package imported."""
