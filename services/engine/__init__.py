"""Model execution for pdserve: loading, the paged KV pool, scheduling, sampling.

torch and transformers only: no networking, no gRPC stubs, no transports.
"""
