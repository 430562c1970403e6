"""Code shared by every pdserve service: config, server bootstrap, shared memory, telemetry.

Importing this package must stay cheap: no torch, no grpc at package level.
"""
