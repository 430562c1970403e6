"""Generated gRPC stubs for the pdserve.v1 protos (tools/gen_protos.py)."""
